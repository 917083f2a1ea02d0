"""Built-in plugins. They register through tinyloop.runtime.hookspecs like any third-party package."""

#: Declared compat cells of a mode that composes with every decode context.
ALL_CONTEXTS_OK = {c: "ok" for c in ("single", "batched", "speculative", "tree_speculative",
                                     "prefix_reuse", "warm_start")}
