"""The base of the app's refusals that name what they refuse. No ``flwr`` or JAX here."""


class Refusal(ValueError):
  """A refusal of ``field`` (a reply's, a run config's or a state file's), with its message;
  pickled whole, so that the field crosses a process boundary."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field

  def __reduce__(self):
    return type(self), (self.field, str(self))
