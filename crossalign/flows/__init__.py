"""Prefect flows: the six-step alignment DAG (embedded or distributed), the step flow that carries out any one
step on a worker of its pool (deployed once per step), the rerun of a step and the nightly regression run."""
