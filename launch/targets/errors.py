"""Errors a target raises for the user's environment (not a bug): printed as one sentence, exit 2."""


class SubmitError(Exception):
    """The scheduler or cloud CLI is missing, refused the request, or the resource failed."""
