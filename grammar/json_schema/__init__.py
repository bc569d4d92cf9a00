"""The JSON Schema compiler: a schema in, a regex (or, where recursion needs it, a grammar) out.

Exact or refused (fail closed): see :mod:`stencil.grammar.json_schema.schema_compiler` for what is enforced and
how. The type modules (``objects``, ``arrays``, ``strings``, ``numbers``) write the regex of one
JSON type each; ``merge``, ``oneof`` and ``refs`` rewrite schemas before that; ``rx`` and
``stencil.grammar.charset`` (one floor down, where ``charclass`` reads it too) are the regex
combinators they share; ``canonical`` serializes values the way the grammar writes them.
"""

__all__ = ["SchemaCompiler", "SchemaOptions", "schema_to_program", "schema_to_regex"]


def __getattr__(name: str):
    # The compiler loads on first use of these names (PEP 562), so that importing one of the
    # package's leaf modules (``rx``, ``canonical``) does not load the whole compiler.
    if name in __all__:
        from stencil.grammar.json_schema import schema_compiler

        return getattr(schema_compiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
