# Thin wrappers: the scripts are the source of truth (they also run where make is absent).
.PHONY: lab test test-fast bench fixtures clean deb

lab:
	bash scripts/lab.sh

test:
	bash scripts/test.sh

test-fast:
	bash scripts/test-fast.sh

bench:
	bash scripts/setup.sh && .venv/bin/python bench/bench_discovery.py

# Materialise every fixture host (cache: .cache/fixture-hosts) and link fixtures/hosts/<name> to it.
fixtures:
	bash scripts/setup.sh && .venv/bin/python -m lab.fixture_hosts --link

# dist/gpuaas-agent_<version>_amd64.deb (GPUAAS_DEB_VERSION=... overrides the version).
deb:
	/usr/bin/python3 packaging/build_deb.py

clean:
	rm -rf .venv out .pytest_cache .cache
