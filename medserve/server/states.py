"""A job's states, shared by the job queue, its API and the CLI client. This module imports nothing: the client
knows them without loading the inference stack."""

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
FINAL_STATES = ("succeeded", "failed", "cancelled")
