"""The user-facing entry point: ``tag.optimize(graph_def, topology) -> Plan`` (IR -> groups -> search -> rewrite)."""
