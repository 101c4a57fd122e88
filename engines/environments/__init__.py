"""Environments brought from outside rollflow (`rollout.environment`): verifiers, OpenEnv, or
one a user wrote. `base` says what rollflow needs of one, `registry` opens them by URI, and
`rows` turns their tasks into prompt rows and their episodes into the gateway's agent."""
