"""Metrics, verdicts, diagnoses, plots and reports of a loss comparison (DAG step 6)."""
