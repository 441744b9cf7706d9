"""The routing rule and its books: pure, no I/O and no clock.

``core.RoutingCore`` decides; ``scheduler`` states the rule (``choose``) and ``load_groups``
holds its fast twin; ``load``, ``residency``, ``sessions`` and ``pressure`` are the books the
rule reads; ``prompt_path`` turns a prompt into the block hashes the index is asked about.
Everything here takes values and returns values: times come in as arguments.
"""
