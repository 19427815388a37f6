"""Command-line tools (tag-deploy, tag-topo, tag-profile, tag-worker): thin wrappers over the library."""
