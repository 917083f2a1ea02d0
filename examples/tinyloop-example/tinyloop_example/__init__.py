"""A third-party TinyLoop plugin package (see docs/PLUGINS.md): registered through the ``tinyloop``
entry-point group, exactly as the built-in plugins register."""
