# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: run test check lint docs docs-serve

# Material for MkDocs prints an end-of-life banner on every build; --quiet would hide
# warnings from --strict too (mkdocs then counts none), so the banner is turned off instead.
MKDOCS := NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs

run:
	scripts/setup.sh --vllm
	.venv/bin/feather bench --json out/bench.json --plot out/bench.png

test:
	scripts/setup.sh --vllm --sglang --ray --datasets --drift
	.venv/bin/ruff check src tests
	.venv/bin/mypy
	.venv/bin/python -m pytest -q -n 2 --dist loadfile
	$(MKDOCS) build --strict --site-dir site

# The fast tier: ruff, mypy (the adapters hold the runtime as core.RuntimeContract:
# pyproject.toml's [tool.mypy]), then every test that starts no engine process and takes
# no minutes (tests/conftest.py marks those `engine` and `slow`).
check:
	.venv/bin/ruff check src tests
	.venv/bin/mypy
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not engine and not slow"

lint:
	.venv/bin/ruff check src tests

# The options page and the contract table are generated from the code (tests/test_docs.py fails while one is stale).
docs:
	.venv/bin/python -m feather_sched.docs --out docs/options.md --contract docs/architecture.md
	$(MKDOCS) build --strict --site-dir site

docs-serve:
	$(MKDOCS) serve --strict
