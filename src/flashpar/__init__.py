"""flashpar: communication/computation overlap with no exposed tail, and document-aware context parallelism."""

__version__ = "0.1.0"
