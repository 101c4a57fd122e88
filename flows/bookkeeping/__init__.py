"""What the driver keeps and checks about a run beside its flows: checks before step 0
(preflight.py), who drives it (driver_record.py), its labels in the Prefect UI, metric
sinks, reports, and what a failure says (root_cause.py, failure_notice.py)."""
