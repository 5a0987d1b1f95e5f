"""Tenants: key hashing and lookup, bearer parsing, token buckets on a hand-driven clock."""

from __future__ import annotations

import pytest

from dpd.config.load import ConfigError, parse_config
from dpd.config.model import TenantSpec
from dpd.router.errors import ApiError
from dpd.router.tenants import Tenant, TenantRegistry, TokenBucket, bearer_key, hash_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hash_key_is_sha256_hex():
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "Bearer   ", "abc", "Token x"])
def test_malformed_authorization_is_a_401(header):
    with pytest.raises(ApiError) as err:
        bearer_key(header)
    assert err.value.status == 401


def test_bearer_key_parsing():
    assert bearer_key(None) is None
    assert bearer_key("Bearer k-1") == "k-1" and bearer_key("bearer  k-1 ") == "k-1"


def registry(**limits) -> TenantRegistry:
    specs = (
        TenantSpec(name="a", apiKeySha256=(hash_key("key-a"),), **limits),
        TenantSpec(name="b", apiKeySha256=(hash_key("key-b"), hash_key("key-b2")), dedicatedWorkers=("decode-1",)),
    )
    return TenantRegistry(specs)


def test_keys_map_to_their_tenant_and_unknown_or_missing_keys_are_401():
    reg = registry()
    assert reg.authenticate("Bearer key-a").name == "a"
    assert reg.authenticate("Bearer key-b2").name == "b"
    for header in (None, "Bearer nope", "Bearer KEY-A"):
        with pytest.raises(ApiError) as err:
            reg.authenticate(header)
        assert err.value.status == 401 and err.value.body()["error"]["code"] == "invalid_api_key"
    assert reg.owners() == {"decode-1": "b"}


def test_no_tenants_means_open():
    assert TenantRegistry(()).authenticate(None) is None


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    clock = Clock()
    bucket = TokenBucket(2.0, 4, clock)
    for _ in range(4):
        assert bucket.wait_s(1) == 0
        bucket.take(1)
    assert bucket.wait_s(1) == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.wait_s(1) == 0
    clock.now += 100
    assert bucket.level == 4  # capped at the burst


def test_a_cost_over_the_burst_waits_for_a_full_bucket_then_goes_into_debt():
    clock = Clock()
    bucket = TokenBucket(100.0, 1000, clock)
    assert bucket.wait_s(5000) == 0  # full bucket: admitted
    bucket.take(5000)
    assert bucket.level == -4000
    assert bucket.wait_s(1) == pytest.approx(40.01)


def test_tenant_limits_refuse_with_429_and_retry_after_without_charging():
    clock = Clock()
    spec = TenantSpec(name="a", apiKeySha256=(hash_key("k"),), requestsPerSecond=1, burstRequests=2,
                      promptTokensPerSecond=100, burstPromptTokens=300)
    tenant = Tenant.from_spec(spec, clock)
    tenant.check_limits(100)
    tenant.check_limits(100)
    with pytest.raises(ApiError) as err:  # the request bucket is empty
        tenant.check_limits(10)
    assert err.value.status == 429 and err.value.param == "requests_per_second" and err.value.retry_after_s == 1
    clock.now += 1.0
    with pytest.raises(ApiError) as err:  # one request token back, but only 200 prompt tokens
        tenant.check_limits(250)
    assert err.value.param == "prompt_tokens_per_second" and err.value.retry_after_s == 1
    assert tenant.requests.level == pytest.approx(1.0)  # the refused request took nothing
    tenant.check_limits(200)


VALID = "0" * 64


@pytest.mark.parametrize(
    "tenants, message",
    [
        ([{"name": "a", "apiKeySha256": ["xyz"]}], "not a lowercase hex SHA-256"),
        ([{"name": "a", "apiKeySha256": []}], "apiKeySha256"),
        ([{"name": "a", "apiKeySha256": [VALID]}, {"name": "a", "apiKeySha256": ["1" * 64]}], "duplicate name"),
        ([{"name": "a", "apiKeySha256": [VALID]}, {"name": "b", "apiKeySha256": [VALID]}], "listed twice"),
        ([{"name": "a", "apiKeySha256": [VALID], "dedicatedWorkers": ["decode-7"]}], "no worker 'decode-7'"),
        ([{"name": "a", "apiKeySha256": [VALID], "dedicatedWorkers": ["decode-0"]},
          {"name": "b", "apiKeySha256": ["1" * 64]}], "every decoder is dedicated"),
        ([{"name": "a", "apiKeySha256": [VALID], "requestsPerSecond": 0}], "requestsPerSecond"),
        ([{"name": "Bad_Name", "apiKeySha256": [VALID]}], "name"),
    ],
)
def test_bad_tenant_configs_are_refused_with_the_field(tenants, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"spec": {"tenants": tenants}})
    assert message in str(err.value)


def test_dedicated_workers_are_accepted_when_consistent():
    config = parse_config({"spec": {
        "pdSpec": {"decodingSpec": {"replicas": 2}},
        "tenants": [{"name": "a", "apiKeySha256": [VALID]}, {"name": "b", "apiKeySha256": ["1" * 64], "dedicatedWorkers": ["decode-1"]}],
    }})
    assert config.spec.tenants[1].dedicatedWorkers == ("decode-1",)


def test_dpd_route_takes_router_settings_and_tenants_from_a_config(tmp_path):
    from dpd.cli import build_parser, route_settings

    path = tmp_path / "c.yaml"
    path.write_text(
        "spec:\n  modelName: mine\n  pdSpec:\n    routingThreshold: 77\n    router: {port: 9001, admission: {decode: {maxInFlight: 3}}}\n"
        f"  tenants: [{{name: a, apiKeySha256: ['{VALID}']}}]\n"
    )
    args = build_parser().parse_args(["route", "--decode", "http://d", "--tokenizer", "t", "--config", str(path), "--host", "0.0.0.0"])
    settings = route_settings(args)
    assert (settings.spec.port, settings.spec.host, settings.threshold_tokens, settings.model_name) == (9001, "0.0.0.0", 77, "mine")
    assert settings.spec.admission.decode.maxInFlight == 3 and settings.tenants[0].name == "a"


def test_dpd_route_sends_the_workers_key(monkeypatch):
    """Workers require the key dpd serve generated (issue 16, finding 1): a standalone router
    takes it from DPD_WORKER_API_KEY (or --worker-key), else every hop is a 401."""
    from dpd.cli import build_parser, route_settings

    monkeypatch.setenv("DPD_WORKER_API_KEY", "k-env")
    args = build_parser().parse_args(["route", "--decode", "http://d", "--tokenizer", "t"])
    assert route_settings(args).worker_api_key == "k-env"
    args = build_parser().parse_args(["route", "--decode", "http://d", "--tokenizer", "t", "--worker-key", "k-arg"])
    assert route_settings(args).worker_api_key == "k-arg"


# -- concurrency caps and output metering (issue 16, finding 6) ------------------------------------
def test_a_tenant_over_its_concurrency_cap_is_refused_until_one_finishes():
    tenant = Tenant.from_spec(TenantSpec(name="t", apiKeySha256=(VALID,), maxConcurrentRequests=2))
    leave = [tenant.enter(), tenant.enter()]
    with pytest.raises(ApiError) as info:
        tenant.enter()
    assert info.value.status == 429 and info.value.param == "max_concurrent_requests"
    leave[0]()
    leave[0]()  # idempotent
    assert tenant.num_in_flight == 1
    tenant.enter()


def test_generated_tokens_are_metered_and_a_tenant_in_debt_waits():
    clock = [0.0]
    spec = TenantSpec(name="t", apiKeySha256=(VALID,), outputTokensPerSecond=10, burstOutputTokens=20)
    tenant = Tenant.from_spec(spec, clock=lambda: clock[0])
    tenant.check_limits(5)
    tenant.meter_output(50)  # an answer longer than the bucket: 30 tokens of debt
    with pytest.raises(ApiError) as info:
        tenant.check_before_work()
    assert info.value.param == "output_tokens_per_second" and info.value.retry_after_s == 3
    clock[0] = 3.0
    tenant.check_before_work()
