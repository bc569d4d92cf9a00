"""The JSON Schema compiler: a schema in, a regex (or, where recursion needs it, a grammar) out.

Exact or refused (fail closed): see :mod:`grammar.json_schema.compiler` for what is enforced and
how. The type modules (``objects``, ``arrays``, ``strings``, ``numbers``) write the regex of one
JSON type each; ``merge``, ``oneof`` and ``refs`` rewrite schemas before that; ``rx`` and
``charset`` are the regex combinators they share; ``canonical`` serializes values the way the
grammar writes them.
"""

from grammar.json_schema.compiler import SchemaCompiler, SchemaOptions, schema_to_program, schema_to_regex

__all__ = ["SchemaCompiler", "SchemaOptions", "schema_to_program", "schema_to_regex"]
