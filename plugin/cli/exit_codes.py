"""The ``kvroute`` commands' exit statuses: ``USAGE_ERROR`` (2) for what a user can fix (bad config, missing
extra, a wait that timed out), 1 for anything else."""

USAGE_ERROR = 2
