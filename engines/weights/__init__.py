"""Moving the policy's weights from the trainer to the engines: the wire formats (sync.py),
the trainer's senders (sender.py) and when a step pushes (schedule.py)."""
