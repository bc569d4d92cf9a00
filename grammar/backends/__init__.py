"""Grammar backends behind one interface (``build(program) -> grammar``, ``grammar.matcher()``).

``eager`` (outlines-core: a token index per regex, µs masks, seconds to build the large ones) and
``lazy`` (llguidance: lexer states and masks computed on demand, context-free grammars, about a
millisecond to the first mask). :mod:`stencil.grammar.backends.backend_registry` imports them lazily: this package
stays light, because the eager build child (``python -m stencil.grammar.backends.index_worker``) starts
from it.
"""
