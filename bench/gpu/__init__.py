"""The torch engine on a real device, one module per benchmark (``python -m bench.gpu``:
:mod:`bench.gpu.__main__` lists the sections)."""
