"""verifiers environments written for the tests (import verifiers: only the verifiers tests
use them)."""
