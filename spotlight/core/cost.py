"""What a run's GPUs cost: GPU-seconds per pool times the price in effect when they were used.

Two pools, `ON_DEMAND` (the trainer's node) and `SPOT` (explorers), named as the Ray resources
that `spot.localray` gives the nodes.
The driver calls `CostLedger.charge` once per iteration; it charges the wall time since the
previous call to both pools and saves the ledger atomically to `cost.json` in the run directory:

    on_demand   cost.trainer_gpus for the whole time the trainer process runs (model loading,
                rollouts, updates, checkpoints, evaluation: the node is paid for all of it).
    spot        the GPUs *held*, not the GPUs busy: a spot node costs while it is up, whether its
                explorer samples, waits for the next job or still loads the model. The count is the
                `spot` resource of the Ray cluster (`spot.localray.spot_gpus_held`; configs/cluster/aws-spot.yaml
                gives a spot node one unit per GPU, the local CPU cluster one per node), sampled at
                each charge and applied to the whole interval since the previous one. How busy the
                explorers were is `explore/utilisation` in the metrics.

Prices are step functions of time, `[[unix_s, usd_per_gpu_hour], ...]`: a price holds from its
time until the next one (and, before the first, the first price holds). Cost = sum over usage
intervals of GPUs x the integral of the price over the interval, so a price change in the middle
of an interval is applied to the seconds on each side of it. On-demand: the configured price. Spot:
either a fixed discount off on-demand, or EC2's spot price history (`describe_spot_price_history`,
credentials from the standard AWS chain only), price per instance divided by its GPU count. EC2
answers a [start, end] query with the changes inside it *and* the price in effect at start, so a
session reads [its start, now] once and then [last read, now] every cost.refresh_minutes; until a
newer change is read, the last known price is extended (a later read can revise recent seconds).

Resume: the ledger is loaded and continued; seconds of iterations a resumed run repeats were paid
for and stay. Time between two sessions (the process was down) is not charged: the ledger only
knows what it saw. A price source changed between sessions applies from the new session on.

cost.json (`LEDGER_VERSION` 1):

    {"version": 1,
     "pools": {"on_demand": {"source": "...", "since": t, "prices": [[t, usd_per_gpu_h], ...],
                             "usage": [[start_s, end_s, gpus], ...]},
               "spot": {...}}}
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from spotlight.core.files import fsync_path

SPOT, ON_DEMAND = "spot", "on_demand"
"""The two pools: spot nodes (explorers, rollout workers) and the on-demand trainer; also the names
of the Ray resources that mark them (`spot.localray`)."""

logger = logging.getLogger(__name__)

COST_FILE = "cost.json"
LEDGER_VERSION = 1
POOLS = (ON_DEMAND, SPOT)

Steps = list[list[float]]  # [[unix_s, usd_per_gpu_hour], ...], sorted by time
Usage = list[list[float]]  # [[start_s, end_s, gpus], ...]


@dataclass
class CostConfig:
    """What the run's GPUs cost: the ledger `cost.json` in the run directory (`spotlight cost RUN_DIR`, see the module
    docstring).

    The `cost` section of a recipe (`spotlight.config.DiTRecipe.cost`).
    """

    on_demand_usd_per_gpu_hour: float = 6.88
    """On-demand price of one GPU-hour (the trainer's node); the default is about AWS's p5 (H100) list price in
    us-east-1, mid-2025."""
    trainer_gpus: int = 1
    """GPUs of the trainer's on-demand node, charged for the whole run (a CPU run counts as one; a launch of N processes
    charges at least N)."""
    spot_price: Literal["discount", "history"] = "discount"
    """How spot GPU-hours are priced: "discount" = spot_discount off on-demand; "history" = EC2 spot price history
    (boto3, standard AWS credential chain)."""
    spot_discount: float = 0.6
    """"discount": spot price = (1 - spot_discount) x on-demand price."""
    instance_type: str = "p5.4xlarge"
    """"history": the spot instance type whose price is read."""
    gpus_per_instance: int = 1
    """"history": GPUs of instance_type (its price per instance-hour is divided by this)."""
    region: str = "us-east-1"
    """"history": AWS region of the spot nodes."""
    availability_zone: str = ""
    """"history": AZ of the spot nodes; empty = the highest price among the region's AZs at each moment (never
    understates)."""
    product_description: str = "Linux/UNIX"
    """"history": the price's product description."""
    refresh_minutes: float = 15.0
    """"history": read new price changes this often during a run."""

    def validate(self) -> None:
        if self.on_demand_usd_per_gpu_hour < 0:
            raise ValueError(f"cost.on_demand_usd_per_gpu_hour must be >= 0, got {self.on_demand_usd_per_gpu_hour}")
        if not 0 <= self.spot_discount < 1:
            raise ValueError(f"cost.spot_discount must be in [0, 1), got {self.spot_discount}")
        if self.trainer_gpus < 1 or self.gpus_per_instance < 1:
            raise ValueError(
                "cost.trainer_gpus and cost.gpus_per_instance must be >= 1, "
                f"got {self.trainer_gpus}, {self.gpus_per_instance}"
            )
        if self.refresh_minutes <= 0:
            raise ValueError(f"cost.refresh_minutes must be > 0, got {self.refresh_minutes}")
        if self.spot_price == "history" and not (self.instance_type and self.region):
            raise ValueError("cost.spot_price=history needs cost.instance_type and cost.region")


# -- EC2 spot price history ------------------------------------------------------------------------


@dataclass(frozen=True)
class SpotPriceRecord:
    """One row of EC2 spot price history: the price of one instance from `time` on."""

    availability_zone: str
    instance_type: str
    time: float
    """Unix seconds (UTC)."""
    usd_per_hour: float
    """Per instance-hour."""


def fetch_spot_price_history(
    client: Any,
    *,
    instance_type: str,
    product_description: str,
    start: float,
    end: float,
    availability_zone: str = "",
) -> list[SpotPriceRecord]:
    """Every page of `describe_spot_price_history` for one instance type in [start, end].

    Args:
        client: a boto3 EC2 client (its region is the one queried).
        start, end: unix seconds; EC2 also returns the price in effect at `start`.
        availability_zone: one AZ; empty = every AZ of the region.

    Returns:
        The records in time order.
    """
    kwargs: dict[str, Any] = {
        "InstanceTypes": [instance_type],
        "ProductDescriptions": [product_description],
        "StartTime": datetime.fromtimestamp(start, timezone.utc),
        "EndTime": datetime.fromtimestamp(end, timezone.utc),
    }
    if availability_zone:
        kwargs["AvailabilityZone"] = availability_zone
    records = []
    for page in client.get_paginator("describe_spot_price_history").paginate(**kwargs):
        for row in page["SpotPriceHistory"]:
            records.append(
                SpotPriceRecord(
                    availability_zone=row["AvailabilityZone"],
                    instance_type=row["InstanceType"],
                    time=row["Timestamp"].timestamp(),
                    usd_per_hour=float(row["SpotPrice"]),  # a decimal string, e.g. "3.0512"
                )
            )
    return sorted(records, key=lambda r: r.time)


def price_steps(records: list[SpotPriceRecord], gpus_per_instance: int, start: float | None = None) -> Steps:
    """Spot price per GPU-hour as a step function: at each moment the highest price among the AZs.

    With one AZ's records that is its price. With several (the AZ of the spot nodes is not known)
    the highest is charged, so the ledger never understates. Repeated prices are dropped.

    Args:
        start: the query's StartTime. The records before it are the prices in effect at start, one
            per AZ: they make one step at `start` (before it, their maximum would be taken over
            only the AZs whose last change happened to be older).
    """
    moments = sorted(
        (r.time if start is None else max(r.time, start), r.availability_zone, r.usd_per_hour) for r in records
    )
    current: dict[str, float] = {}
    steps: Steps = []
    for i, (t, az, usd) in enumerate(moments):
        current[az] = usd
        if i + 1 < len(moments) and moments[i + 1][0] == t:
            continue  # apply every change at one timestamp before reading the maximum
        price = max(current.values()) / gpus_per_instance
        if not steps or steps[-1][1] != price:
            steps.append([t, price])
    return steps


def ec2_client(region: str) -> Any:
    """A boto3 EC2 client; credentials from the standard chain (environment, ~/.aws, instance profile)."""
    import boto3
    from botocore.config import Config

    from spotlight.core.aws import install_log_redaction

    install_log_redaction()  # botocore's DEBUG request dumps carry the access key id
    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=20)
    return boto3.session.Session().client("ec2", region_name=region, config=config)


# -- the cost of usage ------------------------------------------------------------------------------


def price_at(prices: Steps, t: float) -> float:
    """The price in effect at t (before the first step: the first price)."""
    assert prices, "no prices"
    i = bisect.bisect_right([p[0] for p in prices], t) - 1
    return prices[max(i, 0)][1]


def cost_usd(usage: Usage, prices: Steps) -> float:
    """Sum over intervals of GPUs x the integral of the per-GPU-hour price over the interval."""
    if not usage:
        return 0.0
    times = [p[0] for p in prices]
    usd = 0.0
    for start, end, gpus in usage:
        # Split the interval at the price changes inside it; each piece has one price.
        cuts = [start] + times[bisect.bisect_right(times, start) : bisect.bisect_left(times, end)] + [end]
        for a, b in zip(cuts, cuts[1:]):
            usd += gpus * (b - a) / 3600 * prices[max(bisect.bisect_right(times, a) - 1, 0)][1]
    return usd


def gpu_seconds(usage: Usage) -> float:
    return sum((end - start) * gpus for start, end, gpus in usage)


def summarize(doc: dict) -> dict:
    """Per pool GPU-seconds, price source and USD; the total; and what on-demand only would cost.

    "On-demand only" prices every GPU-second of both pools at the on-demand price of its moment.
    """
    pools = doc["pools"]
    out = {
        name: {"gpu_s": gpu_seconds(p["usage"]), "usd": cost_usd(p["usage"], p["prices"]), "source": p["source"]}
        for name, p in pools.items()
    }
    total = sum(p["usd"] for p in out.values())
    all_usage = [u for p in pools.values() for u in p["usage"]]
    on_demand_only = cost_usd(all_usage, pools[ON_DEMAND]["prices"])
    starts = [u[0] for u in all_usage]
    ends = [u[1] for u in all_usage]
    return {
        "pools": out,
        "gpu_s_total": sum(p["gpu_s"] for p in out.values()),
        "usd_total": total,
        "usd_on_demand_only": on_demand_only,
        "usd_saved": on_demand_only - total,
        "saved_fraction": (on_demand_only - total) / on_demand_only if on_demand_only > 0 else 0.0,
        "first": _iso(min(starts)) if starts else None,
        "last": _iso(max(ends)) if ends else None,
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- the ledger file --------------------------------------------------------------------------------


def read_ledger(path: str | os.PathLike) -> dict:
    """Load and check a cost.json; a missing or malformed file is a ValueError naming it."""
    path = Path(path)
    if path.suffix != ".json":  # a run directory
        path = path / COST_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no cost ledger there (`spotlight train` writes {COST_FILE} into the run directory)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        _check(doc)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a valid cost ledger: {e}") from None
    return doc


def _check(doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
        raise ValueError(f'expected a JSON object with "version": {LEDGER_VERSION}')
    if set(doc["pools"]) != set(POOLS):
        raise ValueError(f"expected pools {list(POOLS)}, got {list(doc['pools'])}")
    for name, p in doc["pools"].items():
        if not isinstance(p["source"], str) or not _finite(p["since"]) or not p["prices"]:
            raise ValueError(f"pool {name!r} needs a source and at least one price")
        for row in p["prices"]:
            if len(row) != 2 or not all(_finite(x) for x in row) or row[1] < 0:
                raise ValueError(f"pool {name!r}: bad price step {row!r}")
        if any(a[0] >= b[0] for a, b in zip(p["prices"], p["prices"][1:])):
            raise ValueError(f"pool {name!r}: price steps out of time order")
        for row in p["usage"]:
            if len(row) != 3 or not all(_finite(x) for x in row) or row[1] < row[0] or row[2] < 0:
                raise ValueError(f"pool {name!r}: bad usage interval {row!r}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _write_json_atomically(path: Path, doc: dict) -> None:
    """Temp sibling, fsync, os.replace, fsync the directory: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def _set_aside(path: Path) -> Path:
    """Rename a damaged file to `<name>.damaged[.N]` beside it (never deleted)."""
    dest, n = path.with_name(path.name + ".damaged"), 1
    while dest.exists():
        dest, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    os.replace(path, dest)
    return dest


class CostLedger:
    """GPU-seconds and prices of a run, charged by the driver and kept in `run_dir/cost.json`.

    Args:
        run_dir: the run directory.
        cfg: prices and the trainer's GPU count.
        resume: continue the ledger already in run_dir (if any); False starts a new one.
        client: the EC2 client for spot_price "history" (default: `ec2_client(cfg.region)`).
        now: unix time the session starts (default: now); the first charge starts from it.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: CostConfig,
        *,
        resume: bool = True,
        client: Any = None,
        now: float | None = None,
    ):
        now = time.time() if now is None else now
        self.path = Path(run_dir) / COST_FILE
        self.cfg = cfg
        self.doc: dict = {}
        if resume and self.path.exists():
            try:
                self.doc = read_ledger(self.path)
            except ValueError as err:
                # A damaged ledger must not block the run: keep it for a person, start a new one.
                aside = _set_aside(self.path)
                logger.warning(
                    "%s; moved to %s, and this run starts a new ledger (the time it held is not counted)", err, aside
                )
        if not self.doc:
            pools = {name: {"source": "", "since": now, "prices": [], "usage": []} for name in POOLS}
            self.doc = {"version": LEDGER_VERSION, "pools": pools}
        self._last = now
        self._spot_gpus = 0
        self._client = None
        self._fetched_until = now
        od = cfg.on_demand_usd_per_gpu_hour
        self._set_prices(ON_DEMAND, f"config: {od:g} USD/GPU-hour", [[now, od]], now)
        if cfg.spot_price == "discount":
            self._set_prices(SPOT, f"{cfg.spot_discount:.0%} off on-demand", [[now, od * (1 - cfg.spot_discount)]], now)
        else:
            self._client = client if client is not None else ec2_client(cfg.region)
            where = cfg.availability_zone or f"{cfg.region}, highest AZ"
            self._history_source = (
                f"EC2 spot price history: {cfg.instance_type} {cfg.product_description} ({where}), "
                f"/ {cfg.gpus_per_instance} GPU"
            )
            steps = self._read_history(now, now)
            if not steps:
                raise ValueError(
                    f"EC2 has no spot price history for {cfg.instance_type} ({cfg.product_description}) in "
                    f"{cfg.availability_zone or cfg.region}: check cost.instance_type, cost.availability_zone "
                    "and cost.product_description"
                )
            self._set_prices(SPOT, self._history_source, steps, now)
        self.save()

    def charge(self, spot_gpus: int, now: float | None = None) -> None:
        """Charge the time since the previous charge: trainer_gpus on-demand and spot_gpus spot GPUs; save."""
        now = time.time() if now is None else now
        if self._client is not None and now - self._fetched_until >= 60 * self.cfg.refresh_minutes:
            self._refresh(now)
        self._add(ON_DEMAND, self._last, now, self.cfg.trainer_gpus)
        self._add(SPOT, self._last, now, spot_gpus)
        self._last, self._spot_gpus = now, spot_gpus
        self.save()

    def summary(self) -> dict:
        return summarize(self.doc)

    def metrics(self) -> dict[str, float]:
        """The run's cost so far, for the iteration's metrics."""
        s = self.summary()
        od, sp = s["pools"][ON_DEMAND], s["pools"][SPOT]
        return {
            "cost/usd_total": s["usd_total"],
            "cost/usd_on_demand": od["usd"],
            "cost/usd_spot": sp["usd"],
            "cost/usd_on_demand_only": s["usd_on_demand_only"],
            "cost/gpu_s_on_demand": od["gpu_s"],
            "cost/gpu_s_spot": sp["gpu_s"],
            "cost/spot_gpus_held": self._spot_gpus,
            "cost/spot_usd_per_gpu_hour": price_at(self.doc["pools"][SPOT]["prices"], self._last),
        }

    def save(self) -> None:
        _write_json_atomically(self.path, self.doc)

    # -- internals ------------------------------------------------------------------------------

    def _add(self, pool: str, start: float, end: float, gpus: float) -> None:
        if gpus <= 0 or end <= start:
            return
        usage = self.doc["pools"][pool]["usage"]
        if usage and usage[-1][1] == start and usage[-1][2] == gpus:
            usage[-1][1] = end  # same GPUs as the previous interval, right after it: one interval
        else:
            usage.append([start, end, gpus])

    def _set_prices(self, pool: str, source: str, steps: Steps, now: float) -> None:
        """Merge a source's price steps into a pool's; a new source applies from `now` on."""
        p = self.doc["pools"][pool]
        if p["source"] != source:
            p["source"], p["since"] = source, now
        since = p["since"]
        older = [s for s in p["prices"] if s[0] < since]
        mine = {t: v for t, v in p["prices"] if t >= since}
        before = [v for t, v in steps if t <= since]
        if before:  # the price in effect when this source took over
            mine[since] = before[-1]
        mine.update({t: v for t, v in steps if t > since})
        merged: Steps = []
        for t, v in older + sorted([t, v] for t, v in mine.items()):
            if not merged or merged[-1][1] != v:
                merged.append([t, v])
        p["prices"] = merged

    def _read_history(self, start: float, end: float) -> Steps:
        from botocore.exceptions import BotoCoreError, ClientError

        cfg = self.cfg
        try:
            records = fetch_spot_price_history(
                self._client,
                instance_type=cfg.instance_type,
                product_description=cfg.product_description,
                start=start,
                end=end,
                availability_zone=cfg.availability_zone,
            )
        except (BotoCoreError, ClientError) as e:
            raise ValueError(
                f"cost.spot_price=history: could not read EC2 spot price history in {cfg.region} ({e}); it needs "
                "AWS credentials from the standard chain (environment, ~/.aws, instance profile) allowed "
                "ec2:DescribeSpotPriceHistory, or set cost.spot_price=discount"
            ) from None
        self._fetched_until = end
        return price_steps(records, cfg.gpus_per_instance, start)

    def _refresh(self, now: float) -> None:
        try:
            steps = self._read_history(self._fetched_until, now)
        except ValueError as e:  # keep the last known price; the next charge tries again
            logger.warning("%s; keeping the last known spot price", e)
            return
        self._set_prices(SPOT, self._history_source, steps, now)
