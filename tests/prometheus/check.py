"""Runs the Grafana dashboards' queries against a real Prometheus (run by
scripts/check-prometheus).

Starts a sluice-controller (SQLite in a temp dir), two sluice-stages
connected to it, applies a StoragePool shared by two JobPolicies with
`sluicectl apply`, and runs trainers (the Python client) reading a small
generated dataset for the whole test: the demo job on both stages, held at
its limit (greedy: it wants more than it has), and a batch job on the first
stage reading a steady trickle (compute-bound: its demand is estimated, so
the demand gauge has series). Every demo trainer also hits a missing file
now and then (a whole-file read and a sample of its plan), so the error
panels have series. Both stages have a node cache smaller than the data
set, so later epochs hit it and it rejects what does not fit; the first
also has a disk tier and a second data set. A real Prometheus scrapes the
controller and both stages every second (with the `namespace` label the
chart's ServiceMonitors add); once it runs (a quarter of the way into a
`--duration` run), the second data set is staged with `sluicectl stage`
and then read by the batch job, so the first data set's share of the cache
shrinks and the cache evicts. Once enough samples exist:

- every PromQL expression of helm/sluice/dashboards/*.json (panel targets
  and templating queries, with the template variables substituted) runs
  through Prometheus's HTTP API and must return at least one series;
- every metric name the expressions mention must have series (so
  `... or vector(0)` cannot hide a misspelled name);
- `promtool check metrics` must find nothing to report in either daemon's
  /metrics;
- the chart's PrometheusRule, rendered with Helm's engine (from
  scripts/check-helm's .venv-helm; missing, it fails), passes `promtool
  check rules`, every alert's expression evaluates without an error, and
  every series selector in it (metric name and label matchers, e.g.
  `sluice_controller_stages{namespace="sluice",state="lost"}`) has series:
  an alert on a metric or label value that does not exist would never fire.

The staging series (`sluice_stage_cache_staging_*`) exist only once a
staging round ran: when the controller or sluicectl of this build cannot
stage (no `DatasetCache` kind, no `sluicectl stage`), the queries naming
them are skipped, not failed.

`--render DIR` also plots every panel's series over the test run (one
subplot per panel) into DIR/dashboard-<name>.png. Prints one line per check
and a summary; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = Path(os.environ.get("SLUICE_DASHBOARDS", ROOT / "helm" / "sluice" / "dashboards"))
BIN = Path(os.environ.get("SLUICE_BIN_DIR", ROOT / "target" / "debug"))
JOB = "demo-job"
BATCH_JOB = "batch-job"
POOL = "demo-pool"
NAMESPACE = "sluice"  # as the chart's rules select, and its ServiceMonitors label
RATE_INTERVAL = "5s"
WARMUP = 8.0        # seconds of scrapes before the first evaluation
DEADLINE = 45.0     # seconds after Prometheus started to get every query answered

POLICY = """apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {{name: demo-pool}}
spec: {{capacity: {{bandwidth: 100MB/s, ops: 20k ops/s}}}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: demo}}
spec:
  selector: {{matchLabels: {{team: demo}}}}
  pool: demo-pool
  limit: {{bandwidth: {limit}MB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: batch}}
spec:
  selector: {{matchLabels: {{team: batch}}}}
  pool: demo-pool
"""

# One trainer: reads its stage's dataset epoch after epoch until killed.
# Every epoch also reads a missing file whole (an error frame) and its plan
# holds a sample whose file was removed after the dataset was listed (a
# failed sample).
TRAINER = r"""
import sys, time, sluice
from sluice.errors import SluiceError
sock, job = sys.argv[1], sys.argv[2]
with sluice.Client(sock, job=job, labels={"team": "demo"}) as c:
    ds = c.dataset("demo")
    print("ready", flush=True)
    epoch = 0
    while True:
        try:
            ds.read("missing.bin")
        except SluiceError:
            pass
        for name, data in ds.epoch(epoch, seed=7, batch=16, on_error="yield"):
            pass
        epoch += 1
"""

# The batch job's trainer: whole-file reads at a steady pace, far below its
# share of the pool, so it is never throttled and its demand is estimated.
BATCH_TRAINER = r"""
import sys, time, sluice
sock, job, dataset = sys.argv[1], sys.argv[2], sys.argv[3]
with sluice.Client(sock, job=job, labels={"team": "batch"}) as c:
    ds = c.dataset(dataset)
    names = [n for n in ds.files.names() if n.startswith("sample-")]
    print("ready", flush=True)
    while True:
        for name in names:
            ds.read(name)
            time.sleep(0.01)
"""

# The first stage's second data set: staged, then read by the batch job,
# once the demo data set has filled that stage's memory tier.
EXTRA = "extra"
CACHE_POLICY = """apiVersion: sluice.dev/v1
kind: DatasetCache
metadata: {name: extra}
spec:
  dataset: extra
  staging: {pool: demo-pool, rate: 1MiB/s}
"""
# Series that exist only once a staging round ran.
STAGING_METRICS = {"sluice_stage_cache_staging_bytes_total", "sluice_stage_cache_staging_samples"}

results: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, ok, detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Daemons:
    """The processes this run started; stop() ends them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], ready_line: bool = True, **kw) -> dict | None:
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if ready_line else log, stderr=log,
                                text=True, **kw)
        self.procs.append((name, proc))
        if not ready_line:
            return None
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=10)
            raise RuntimeError(f"{name} did not start (exit {proc.returncode}); log:\n"
                               + (self.tmp / f"{name}.log").read_text()[-2000:])
        return json.loads(line) if line.startswith("{") else {"line": line.strip()}

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()

    def check_alive(self) -> list[str]:
        return [f"{n} exited with {p.returncode}" for n, p in self.procs if p.poll() is not None]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = http_get(url, timeout=10)
        except urllib.error.HTTPError as e:
            body = e.read()
        return json.loads(body)

    def query(self, expr: str) -> tuple[str | None, list]:
        """(error or None, result series)."""
        r = self.api("query", query=expr)
        if r.get("status") != "success":
            return f"{r.get('errorType')}: {r.get('error')}", []
        return None, r["data"]["result"]


# -- the dashboards ----------------------------------------------------------

def dashboard_queries(path: Path) -> tuple[list[tuple[str, str]], list[dict]]:
    """([(where, expr)] of the panels' targets, the query variables)."""
    d = json.loads(path.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                if t.get("expr"):
                    exprs.append((f"panel {p.get('title')!r} {t.get('refId', '')}", t["expr"]))

    walk(d.get("panels", []))
    variables = [v for v in d.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs, variables


def variable_query(v: dict) -> str:
    q = v.get("query")
    if isinstance(q, dict):
        q = q.get("query")
    return q or v.get("definition", "")


def substitute(expr: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        expr = expr.replace("${" + name + "}", value)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", lambda _: value, expr)
    if "$" in expr:
        raise ValueError(f"unknown template variable left in {expr!r}")
    return expr


def variable_promql(q: str) -> tuple[str, str | None]:
    """A Grafana Prometheus variable query as PromQL, with the label whose
    values it lists (None: query_result / plain expression)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q, re.S)
    if m:
        return f"count by ({m.group(2)}) ({m.group(1)})", m.group(2)
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", q, re.S)
    if m:
        return m.group(1), None
    return q, None


# Grafana units -> (factor, axis label) for --render.
UNITS = {"Bps": (1e-6, "MB/s"), "bytes": (1 / 2**20, "MiB"), "percentunit": (100.0, "%"),
         "s": (1e3, "ms"), "ops": (1.0, "per second"), "reqps": (1.0, "per second")}

METRIC_RE = re.compile(r"\b(sluice_[a-z0-9_]+)\b")


# -- checks -----------------------------------------------------------------

def promtool_metrics(name: str, url: str) -> None:
    body = http_get(url)
    p = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    out = (p.stdout + p.stderr).decode().strip()
    record(f"promtool check metrics: {name}", p.returncode == 0 and not out,
           f"exit {p.returncode}: {out}")


def chart_rules() -> tuple[list[dict], str]:
    """The PrometheusRule's rule groups, rendered from the chart with Helm's
    own engine in scripts/check-helm's environment; ([], why) when that
    cannot be done."""
    py = Path(os.environ.get("SLUICE_HELM_VENV", ROOT / ".venv-helm")) / "bin" / "python"
    if not py.exists():
        return [], f"no {py.parent.parent} (run scripts/check-helm once)"
    script = (
        "import sys, json, helm_python as helm, yaml\n"
        "with helm.Chart.load(sys.argv[1]) as c:\n"
        "    m = c.render({'metrics': {'prometheusRule': {'enabled': True}}}, name='sluice', namespace=sys.argv[2], is_install=True)\n"
        "for path, text in m.items():\n"
        "    if not path.endswith('.yaml'): continue\n"
        "    for o in yaml.safe_load_all(text):\n"
        "        if o and o.get('kind') == 'PrometheusRule':\n"
        "            print(json.dumps(o['spec']['groups']))\n"
    )
    p = subprocess.run([str(py), "-c", script, str(ROOT / "helm" / "sluice"), NAMESPACE],
                       capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        return [], p.stderr.strip()[-500:] or "no PrometheusRule rendered"
    return json.loads(p.stdout), ""


def promtool_rules(tmp: Path, groups: list[dict]) -> None:
    rules = tmp / "rules.json"
    rules.write_text(json.dumps({"groups": groups}))  # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    record("promtool check rules: the chart's PrometheusRule", r.returncode == 0,
           (r.stdout + r.stderr).strip())


SELECTOR_RE = re.compile(r"\b(sluice_[a-z0-9_]+)(\{[^{}]*\})?")


def rule_queries(groups: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(name, expr)] of every alert and recording rule, [(name, count
    query)] of every series selector in them); a rule that selects no
    sluice metric, or whose name is taken, fails here."""
    exprs, selectors = [], []
    for g in groups:
        for rule in g.get("rules", []):
            name = f"rule {rule.get('alert') or rule.get('record')}"
            if name in dict(exprs):
                record(f"{name}: one rule of that name", False, "defined twice")
            expr = str(rule["expr"])
            exprs.append((name, expr))
            for sel in dict.fromkeys(m.group(0) for m in SELECTOR_RE.finditer(expr)):
                selectors.append((f"{name}: series {sel}", f"count({sel})"))
            if not SELECTOR_RE.search(expr):
                record(f"{name}: selects a sluice metric", False, f"no sluice_* selector in {expr!r}")
    return exprs, selectors


def render(prom: Prometheus, panels_by_dash: dict[str, list[tuple[str, tuple[str, str, list[tuple[str, str]]]]]],
           start: float, end: float, out: Path) -> None:
    """Plots each panel's series; a state timeline as one bar per series,
    drawn where the series exists."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for dash, panels in panels_by_dash.items():
        cols = 3
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 3.0), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (title, (kind, unit, targets)) in zip(axes.flat, panels):
            scale, suffix = UNITS.get(unit, (1.0, ""))
            bars = []
            for expr, legend in targets:
                r = prom.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1")
                for series in r.get("data", {}).get("result", []):
                    ts = [float(t) - start for t, _ in series["values"]]
                    vs = [float(v) * scale for _, v in series["values"]]
                    label = re.sub(r"\{\{\s*(\w+)\s*\}\}",
                                   lambda m: series["metric"].get(m.group(1), ""), legend or "") or expr[:40]
                    if kind == "state-timeline":
                        bars.append((label, ts))
                    else:
                        ax.plot(ts, vs, label=label, linewidth=1)
            for row, (label, ts) in enumerate(sorted(bars)):
                # [start, width] runs of consecutive steps (1 s apart).
                runs: list[list[float]] = []
                for t in ts:
                    if runs and t - sum(runs[-1]) < 0.5:
                        runs[-1][1] += 1
                    else:
                        runs.append([t, 1.0])
                ax.broken_barh(runs, (row - 0.35, 0.7))
            if bars:
                ax.set_yticks(range(len(bars)), [label for label, _ in sorted(bars)], fontsize=7)
            ax.set_title(title + (f" ({suffix})" if suffix else ""), fontsize=9)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("seconds into the test run", fontsize=7)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left")
        fig.suptitle(f"sluice / {dash} (Prometheus data of scripts/check-prometheus; "
                     f"jobs {JOB} and {BATCH_JOB}, one stage for per-stage panels)", fontsize=11)
        # Room for the title above the first row, whatever the rows.
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
        path = out / f"dashboard-{dash}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        print(f"rendered {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", metavar="DIR", type=Path,
                    help="also plot every dashboard panel's series into DIR/dashboard-<name>.png")
    ap.add_argument("--duration", type=float, default=0, metavar="S",
                    help="let the trainers read for S seconds of scrapes before evaluating, raising the "
                         "job's limit half way (default: as soon as every query has data)")
    ap.add_argument("--dashboards", type=Path, default=DASHBOARDS, help="directory of the dashboards' JSON")
    args = ap.parse_args()
    started = time.monotonic()
    for tool in ("prometheus", "promtool"):
        if not shutil.which(tool):
            print(f"error: {tool} not found (scripts/check-prometheus installs it)", file=sys.stderr)
            return 2
    for b in ("sluice-controller", "sluice-stage", "sluicectl"):
        if not os.access(BIN / b, os.X_OK):
            print(f"error: {BIN / b} not found: cargo build --workspace --bins (or set SLUICE_BIN_DIR)", file=sys.stderr)
            return 2
    dashboards = sorted(args.dashboards.glob("*.json"))
    if not dashboards:
        print(f"error: no dashboards in {args.dashboards}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="sluice-prometheus-") as tmp_name:
        tmp = Path(tmp_name)
        daemons = Daemons(tmp)
        try:
            return run(args, tmp, daemons, dashboards, started)
        finally:
            daemons.stop()


def metric_value(metrics_addr: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples in a daemon's /metrics whose labels
    include `labels` (0 when there is none)."""
    total = 0.0
    for line in http_get(f"http://{metrics_addr}/metrics").decode().splitlines():
        m = re.fullmatch(r"([a-z_:][a-z0-9_:]*)(\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(3) or ""))
        if labels.items() <= have.items():
            total += float(m.group(4))
    return total


def second_data_set(tmp: Path, grpc: str, stage: tuple[Path, str], start_trainer, daemons: Daemons) -> str | None:
    """Once the first stage's memory tier is full of the demo data set (it
    rejects samples), stages the second data set there (1.6 MB at 1 MiB/s)
    and then starts the batch job reading it: the demo data set's share
    halves, so the cache evicts. Returns None when the data set was staged,
    else why not (the staging series are then not required)."""
    deadline = time.monotonic() + 20
    while metric_value(stage[1], "sluice_stage_cache_rejected_total", dataset="demo") == 0:
        if dead := daemons.check_alive():
            raise RuntimeError("; ".join(dead))
        if time.monotonic() > deadline:
            raise RuntimeError("the first stage's cache rejected nothing in 20 s: its memory tier never filled")
        time.sleep(0.2)
    (tmp / "cache-policy.yaml").write_text(CACHE_POLICY)
    why = None
    for argv in (["apply", "-f", str(tmp / "cache-policy.yaml")], ["stage", EXTRA, "--timeout", "30"]):
        r = subprocess.run([str(BIN / "sluicectl"), "--server", f"http://{grpc}", *argv], capture_output=True, text=True)
        if r.returncode != 0:
            why = f"sluicectl {' '.join(argv[:2])}: {(r.stdout + r.stderr).strip()}"
            break
    start_trainer()
    return why


def run(args, tmp: Path, daemons: Daemons, dashboards: list[Path], started: float) -> int:
    data = tmp / "data"
    data.mkdir()
    for i in range(400):
        (data / f"sample-{i:04}.bin").write_bytes(os.urandom(16384 + 64 * i))
    (data / "vanishing.bin").write_bytes(b"gone soon")
    extra = tmp / "extra"
    extra.mkdir()
    for i in range(100):
        (extra / f"sample-{i:04}.bin").write_bytes(os.urandom(16384))

    ready = daemons.start("controller", [str(BIN / "sluice-controller"), "--grpc-addr", "127.0.0.1:0",
                                         "--http-addr", "127.0.0.1:0", "--database-url", f"sqlite://{tmp}/sluice.db"])
    grpc, http = ready["grpc"], ready["http"]

    def apply(limit_mb: int) -> None:
        (tmp / "policy.yaml").write_text(POLICY.format(limit=limit_mb))
        subprocess.run([str(BIN / "sluicectl"), "--server", f"http://{grpc}", "apply", "-f", str(tmp / "policy.yaml")],
                       check=True, stdout=subprocess.DEVNULL)

    apply(8)
    stages = []
    for i in range(2):
        sock = tmp / f"stage{i}.sock"
        # A node cache of a fraction of the data set's 11.6 MB: later epochs
        # hit, and what does not fit is rejected; the first stage also has a
        # disk tier and a second data set.
        cache = ["--cache-memory", "2MiB"]
        if i == 0:
            cache += ["--cache-dir", str(tmp / "cache0"), "--cache-disk", "4MiB", "--dataset", f"{EXTRA}={extra}"]
        r = daemons.start(f"stage{i}", [str(BIN / "sluice-stage"), "--socket", str(sock), "--metrics-addr", "127.0.0.1:0",
                                         "--dataset", f"demo={data}", "--stage-id", f"stage-{i}", "--node", f"node-{i}",
                                         "--memory-budget", "256MiB", "--controller", f"http://{grpc}", *cache])
        stages.append((sock, r["metrics"]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "clients" / "python"),
                                                                     os.environ.get("PYTHONPATH")])))
    trainers = [(f"trainer{i}", TRAINER, sock, JOB) for i, (sock, _) in enumerate(stages)]
    trainers.append(("batch-trainer", BATCH_TRAINER, stages[0][0], BATCH_JOB, "demo"))

    def start_trainer(name, code, sock, job, *argv):
        r = daemons.start(name, [sys.executable, "-c", code, str(sock), job, *argv], env=env)
        if r.get("line") != "ready":
            raise RuntimeError(f"{name} said {r}")

    for trainer in trainers:
        start_trainer(*trainer)
    # Listed by both stages' datasets now: every epoch's plan fails on it.
    (data / "vanishing.bin").unlink()

    port = free_port()
    targets = {"controller": [http], "stage": [m for _, m in stages]}
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # honor_labels as the chart's ServiceMonitors: the `job` label of
            # the stages' and the controller's series is the training job.
            {"job_name": "sluice-controller", "honor_labels": True,
             "static_configs": [{"targets": targets["controller"], "labels": {"namespace": NAMESPACE}}]},
            {"job_name": "sluice-stage", "honor_labels": True,
             "static_configs": [{"targets": [m], "labels": {"node": f"node-{i}", "namespace": NAMESPACE}}
                                for i, m in enumerate(targets["stage"])]},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    daemons.start("prometheus", ["prometheus", f"--config.file={tmp}/prometheus.yml",
                                 f"--storage.tsdb.path={tmp}/tsdb", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], ready_line=False)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    prom_started = time.time()
    deadline = time.monotonic() + DEADLINE

    # Prometheus up and all three targets scraped.
    while True:
        try:
            _, up = prom.query("up == 1")
            if len(up) == 3:
                break
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        if dead := daemons.check_alive():
            raise RuntimeError("; ".join(dead))
        if time.monotonic() > deadline:
            raise RuntimeError("Prometheus did not scrape all three targets in time; see its log")
        time.sleep(0.25)
    print(f"prometheus on 127.0.0.1:{port} scraping {http} (controller), "
          f"{', '.join(targets['stage'])} (stages)", flush=True)
    if args.duration:
        # A longer run (for --render): the second data set comes a quarter
        # of the way in, so the cache panels show the split.
        time.sleep(max(0.0, args.duration / 4 - (time.time() - prom_started)))
    staging = second_data_set(tmp, grpc, stages[0], lambda: start_trainer(
        "extra-trainer", BATCH_TRAINER, stages[0][0], BATCH_JOB, EXTRA), daemons)
    if args.duration:
        print(f"staged and started reading {EXTRA} at {time.time() - prom_started:.1f} s", flush=True)

    # Values for the template variables: both jobs (as Grafana writes a
    # multi-value selection), the pool and the first stage; each query
    # variable must list the value named in `wanted`.
    stage_instance = stages[0][1]
    values = {"job": f"({JOB}|{BATCH_JOB})", "pool": POOL, "instance": stage_instance,
              "stage": stage_instance, "node": "node-0",
              "__rate_interval": RATE_INTERVAL, "__interval": "1s", "__range": "1m"}
    wanted = dict(values, job=JOB)

    checks = []      # (name, expr, label the values of which must include a value, wanted value)
    panels_by_dash = {}
    for path in dashboards:
        exprs, variables = dashboard_queries(path)
        dash = path.stem.removeprefix("sluice-")
        if not exprs:
            record(f"{path.name}: has queries", False, "no panel target has an expr")
        for v in variables:
            q, label = variable_promql(variable_query(v))
            checks.append((f"{path.name}: variable ${v['name']}", substitute(q, values), label, wanted.get(v["name"])))
        panels: dict[str, list] = {}
        for where, expr in exprs:
            checks.append((f"{path.name}: {where}", substitute(expr, values), None, None))
        d = json.loads(path.read_text())

        def walk(ps):
            for p in ps:
                walk(p.get("panels", []))
                ts = [(substitute(t["expr"], values), t.get("legendFormat", "")) for t in p.get("targets", []) if t.get("expr")]
                if ts:
                    unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
                    panels[p.get("title", "")] = (p.get("type", ""), unit, ts)
        walk(d.get("panels", []))
        panels_by_dash[dash] = list(panels.items())

    if staging is not None:
        # This build cannot stage: the staging series cannot exist, so the
        # queries naming them are skipped rather than failed.
        skipped = [c for c in checks if STAGING_METRICS & set(METRIC_RE.findall(c[1]))]
        for name, *_ in skipped:
            print(f"skip {name}: no staging round ({staging})", flush=True)
        checks = [c for c in checks if c not in skipped]
    metrics = sorted({m for _, e, _, _ in checks for m in METRIC_RE.findall(e)})
    groups, why = chart_rules()
    if not groups:
        record("the chart's PrometheusRule renders", False, why)
    rule_exprs, rule_selectors = rule_queries(groups)
    checks += [(name, expr, None, None) for name, expr in rule_selectors]

    def evaluate():
        out = {}
        for name, expr, label, want in checks:
            err, series = prom.query(expr)
            if err:
                out[name] = (False, f"{err} (query: {expr})")
            elif not series:
                out[name] = (False, f"no series (query: {expr})")
            elif label and want and want not in {s["metric"].get(label) for s in series}:
                out[name] = (False, f"{want!r} not among its values "
                                    f"{sorted(s['metric'].get(label, '') for s in series)} (query: {expr})")
            else:
                out[name] = (True, "")
        for name, expr in rule_exprs:
            # An alert is normally quiet: its expression need only evaluate.
            err, _ = prom.query(expr)
            out[f"{name}: evaluates"] = (not err, f"{err} (query: {expr})")
        for m in metrics:
            # `{__name__=...}` with a base name also matches the histogram's
            # series through the regex below.
            err, series = prom.query(f'count({{__name__=~"{m}|{m}_bucket|{m}_count|{m}_sum"}})')
            out[f"metric exists: {m}"] = (not err and bool(series), err or "no series in Prometheus")
        return out

    if args.duration:
        # A longer run (for --render): raise the job's limit half way, so the
        # throughput and settings panels show a change.
        time.sleep(max(0.0, args.duration / 2 - (time.time() - prom_started)))
        apply(16)
        print(f"applied a new limit at {time.time() - prom_started:.1f} s", flush=True)
        time.sleep(max(0.0, args.duration - (time.time() - prom_started)))
        deadline = time.monotonic() + 15
    time.sleep(max(0.0, WARMUP - (time.time() - prom_started)))
    while True:
        if dead := daemons.check_alive():
            raise RuntimeError("; ".join(dead))
        outcome = evaluate()
        # A query Prometheus refuses (a parse error) will not get better.
        refused = any(not ok and d.startswith("bad_data:") for ok, d in outcome.values())
        if all(ok for ok, _ in outcome.values()) or refused or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for name, (ok, detail) in outcome.items():
        record(name, ok, detail)
    # Now that every series exists (errors, tuner changes), check the
    # daemons' exposition with promtool.
    promtool_metrics("sluice-controller /metrics", f"http://{http}/metrics")
    for i, (_, m) in enumerate(stages):
        promtool_metrics(f"sluice-stage {i} /metrics", f"http://{m}/metrics")
    if groups:
        promtool_rules(tmp, groups)
    print(f"{len(checks) - len(rule_selectors)} dashboard queries, {len(metrics)} metric names, "
          f"{len(rule_exprs)} rules with {len(rule_selectors)} series selectors, "
          f"evaluated {time.time() - prom_started:.1f} s after Prometheus started", flush=True)

    if args.render:
        render(prom, panels_by_dash, prom_started, time.time(), args.render)

    failed = sum(1 for _, ok, _ in results if not ok)
    print(f"prometheus checks: {len(results) - failed} passed, {failed} failed "
          f"({time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
