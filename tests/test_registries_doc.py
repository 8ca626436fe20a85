"""docs/registries.md lists every layer kind and metric from their registries, and is current."""

from pathlib import Path

from auditor.render.parts.registries import registries_markdown


def test_docs_registries_md_is_generated_from_the_registries():
    doc = Path(__file__).resolve().parents[1] / "docs" / "registries.md"
    assert doc.read_text(encoding="utf-8") == registries_markdown(), "run `make docs` to regenerate docs/registries.md"


def test_a_kind_registered_later_appears_without_editing_a_table():
    from auditor.kinds.base import LayerKind
    from auditor.kinds.registry import register, unregister

    class Fused(LayerKind):
        kind = "fused_qkv_test"
        label = "FusedQKV"
        swept = True

    k = register(Fused())
    try:
        assert "| `fused_qkv_test` | yes (FusedQKV) | yes |  | X^T X |  |" in registries_markdown()
    finally:
        unregister(k)
    assert "fused_qkv_test" not in registries_markdown()


def test_every_metric_name_is_listed_with_its_direction():
    from auditor.calibration.metrics.registry import names

    page = registries_markdown()
    assert all(f"`{n}`" in page for n in names())
    assert "| `perplexity` | `perplexity`, `ppl` | perplexity increase | lower (zero on the dense model) | percent | " \
           "likelihood | yes |" in page
    assert "| `kl` | `kl` | next-token KL | lower (zero on the dense model) | its own units | likelihood | yes |" in page
