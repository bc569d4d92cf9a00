"""Stencil's Python entry points for users of other runtimes (``stencil.cluster``: Ray Serve).

The service itself lives in the ``service``, ``engine``, ``grammar``, ``kernels`` and
``schemas`` packages; the ``stencil`` command is ``stencil.service.cli``.
"""
