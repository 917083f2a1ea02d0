"""A third-party package installed with a `tinyloop` entry point is found and used like a built-in."""

from __future__ import annotations

import sys
import textwrap

import tinyloop as tl
from tinyloop.runtime.plugins import PluginManager


def test_installed_package_entry_point(tmp_path, monkeypatch, tiny_model, prompt):
    site = tmp_path / "site"
    pkg = site / "tl_example_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from tinyloop.runtime.decoding import Decoder
        from tinyloop.runtime.hookspecs import hookimpl

        class SecondBest(Decoder):
            """Emits the second most likely token."""
            name = "second_best"
            contexts = frozenset({"single", "batched"})

            def decode(self, session):
                session.start()
                while True:
                    tok = int(session.logits().argsort()[-2])
                    yield tok
                    session.advance(tok)

        @hookimpl
        def tinyloop_decoders():
            return [SecondBest]
    '''))
    dist = site / "tl_example_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tl-example-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tinyloop]\ntl_example = tl_example_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        pm = PluginManager()
        assert "second_best" in pm.decoders()
        import tinyloop.runtime.plugins as plugins
        monkeypatch.setattr(plugins, "_manager", pm)
        out = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=3, decoder="second_best"))
        first = tl.score_last_token(tiny_model, prompt)
        assert out[len(prompt)] == int(first.argsort()[-2])
    finally:
        sys.modules.pop("tl_example_plugin", None)
