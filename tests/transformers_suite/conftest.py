"""The markers transformers' model tests carry (registered as transformers' own pytest setup registers them)."""

UPSTREAM_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "generate")


def pytest_configure(config) -> None:
    for marker in (*UPSTREAM_MARKERS, "torch_compile_test"):
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' own model tests")
