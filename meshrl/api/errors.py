"""Errors the API reports to its caller."""


class UserError(ValueError):
    """The request was wrong (unknown loss or model, malformed tensor, bad parameter): fixing the
    request fixes it. The server reports it to the SDK with category `user`; anything else is a
    server error."""
