"""``DEFAULT_TIMEOUT_S``: how long any distributed wait may take unless told otherwise.

Apart from ``flashpar.dist`` (which imports torch) so that the options and the command line's defaults import
without torch.
"""

DEFAULT_TIMEOUT_S = 300.0
"""Default limit for every wait of an overlapped op (seconds)."""
