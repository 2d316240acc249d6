# The two commands of the README. Both set up .venv first (idempotent).
.PHONY: run test lint

run:
	scripts/setup.sh --vllm --sglang
	.venv/bin/feather cht-bench --json out/cht-bench.json

test:
	scripts/setup.sh --vllm --sglang
	.venv/bin/ruff check src tests
	.venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check src tests
