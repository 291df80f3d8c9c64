"""Package data: real document-length lists and MagiAttention's length histogram (sources and licences in
``SOURCES.md``).  Read them through :func:`flashpar.cp.lengths.resolve_lengths`."""
