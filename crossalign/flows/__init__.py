"""Prefect flows: the six-step alignment DAG (embedded or distributed), one flow per step for the
work pools, and the nightly regression run."""
