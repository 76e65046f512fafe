"""The shipped cluster configs parse: Serve app configs and `ray up` cluster configs."""

from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


@pytest.mark.parametrize("name", ["serve.yaml", "serve-gpu.yaml"])
def test_serve_configs_validate_and_their_args_are_known(name):
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import AppSettings

    data = yaml.safe_load((CLUSTER / name).read_text())
    ServeDeploySchema.model_validate(data)
    app = data["applications"][0]
    assert app["import_path"] == "cluster.app:build_app"
    AppSettings.from_args(app["args"]).autoscale()
    if name == "serve.yaml":  # the start contract
        assert data["http_options"] == {"host": "127.0.0.1", "port": 8000} and app["route_prefix"] == "/"
        assert app["args"]["model"] == "default"


def test_unknown_app_args_are_rejected():
    from cluster.app import AppSettings

    with pytest.raises(ValueError, match="modle"):
        AppSettings.from_args({"modle": "default"})


@pytest.mark.parametrize("args, words", [({"reject_delay_s": -1}, "reject_delay"),
                                         ({"reject_delay_max_held": -1}, "reject_delay"),
                                         ({"low_priority_prefill_tokens": 0}, "low_priority_prefill_tokens"),
                                         ({"cache_protect_s": -1}, "cache_protect_s"),
                                         ({"cache_seed_s": -1}, "cache_seed_s"),
                                         ({"import_hold_s": -1}, "import_hold_s")])
def test_flood_knobs_are_checked_when_the_app_is_built(args, words):
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    with pytest.raises(ValueError, match=words):
        AppSettings.from_args(args)
    s = AppSettings.from_args({"low_priority_prefill_tokens": 16, "engine_thread_nice": 2})
    e = pool_config(s, Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})).engine
    assert (e.low_priority_prefill_tokens, e.thread_nice) == (16, 2)  # they reach the workers' engines
    assert (e.guarded_steps_alone, e.interrupt_for_guarded) == (True, True)  # defaults
    e = pool_config(AppSettings.from_args({"guarded_steps_alone": False, "interrupt_for_guarded": False}),
                    Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})).engine
    assert (e.guarded_steps_alone, e.interrupt_for_guarded) == (False, False)
    assert (e.cache_protect_s, e.cache_seed_s) == (60.0, 120.0)  # default: tails before prefixes
    e = pool_config(AppSettings.from_args({"cache_protect_s": 0, "cache_seed_s": 0}),
                    Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})).engine
    assert (e.cache_protect_s, e.cache_seed_s) == (0, 0)  # plain LRU reaches the workers' engines


def test_the_routers_decode_learning_is_an_app_argument_that_reaches_the_pool():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).router_learn_decode is True
    assert pool_config(AppSettings.from_args({"router_learn_decode": False}), tenants).router_learn_decode is False
    assert pool_config(AppSettings.from_args({}), tenants).router_kv_memory is True
    assert pool_config(AppSettings.from_args({"router_kv_memory": False}), tenants).router_kv_memory is False
    assert pool_config(AppSettings.from_args({}), tenants).guests_yield is False
    assert pool_config(AppSettings.from_args({}), tenants).calibrate_prefill is True
    assert pool_config(AppSettings.from_args({"calibrate_prefill": False}), tenants).calibrate_prefill is False
    assert pool_config(AppSettings.from_args({"guests_yield": True}), tenants).guests_yield is True
    with pytest.raises(ValueError, match="guests_yield must be true or false"):
        AppSettings.from_args({"guests_yield": "false"})  # quoted in YAML: a string, not a bool
    assert pool_config(AppSettings.from_args({}), tenants).lend_workers == "unqueued"
    assert pool_config(AppSettings.from_args({"lend_workers": "idle"}), tenants).lend_workers == "idle"
    with pytest.raises(ValueError, match="lend_workers"):
        AppSettings.from_args({"lend_workers": "always"})
    assert pool_config(AppSettings.from_args({}), tenants).lend_hit_tokens == 64
    assert pool_config(AppSettings.from_args({"lend_hit_tokens": 0}), tenants).lend_hit_tokens == 0
    for bad in (-1, "64", True):
        with pytest.raises(ValueError, match="lend_hit_tokens"):
            AppSettings.from_args({"lend_hit_tokens": bad})


def test_the_routers_short_list_is_an_app_argument_that_reaches_the_pool():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).router_max_candidates == 16
    assert pool_config(AppSettings.from_args({"router_max_candidates": 0}), tenants).router_max_candidates == 0
    for bad in (-1, "16", True, 2.5):
        with pytest.raises(ValueError, match="router_max_candidates must be an integer >= 0"):
            AppSettings.from_args({"router_max_candidates": bad})


def test_fair_share_is_an_app_argument_that_reaches_the_engines():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    engine = pool_config(AppSettings.from_args({}), tenants).engine
    assert engine.fair_share is True and engine.fair_reserve_seqs == 4 and engine.fair_preempt is True
    engine = pool_config(AppSettings.from_args({"fair_share": False, "fair_reserve_seqs": 0, "fair_preempt": False}),
                         tenants).engine
    assert engine.fair_share is False and engine.fair_reserve_seqs == 0 and engine.fair_preempt is False
    for bad in (-1, "4", True, 2.5):
        with pytest.raises(ValueError, match="fair_reserve_seqs must be an integer >= 0"):
            AppSettings.from_args({"fair_reserve_seqs": bad})


def test_the_structured_output_cost_bounds_are_app_arguments_that_reach_the_engine():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    engine = pool_config(AppSettings.from_args({}), tenants).engine
    assert (engine.max_schema_chars, engine.grammar_cache_bytes, engine.grammar_compile_cpu_s) == (131072, 256 << 20, 10.0)
    engine = pool_config(AppSettings.from_args({"max_schema_chars": 1000, "grammar_cache_bytes": 1 << 20,
                                                "grammar_compile_cpu_s": 0}), tenants).engine
    assert (engine.max_schema_chars, engine.grammar_cache_bytes, engine.grammar_compile_cpu_s) == (1000, 1 << 20, 0)
    for bad in ({"max_schema_chars": 0}, {"max_schema_chars": "1000"}, {"grammar_cache_bytes": 0.5},
                {"grammar_compile_cpu_s": -1}, {"grammar_compile_cpu_s": "10"}, {"grammar_compile_cpu_s": True}):
        with pytest.raises(ValueError, match="must be an? (integer|number) >= "):
            AppSettings.from_args(bad)


def test_the_idle_spill_of_hot_groups_is_an_app_argument_that_reaches_the_router():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).placement().idle_slack > 0
    assert pool_config(AppSettings.from_args({"router_idle_spill": False}), tenants).placement().idle_slack == 0


def test_whether_a_spill_needs_the_groups_share_of_the_cluster_is_an_app_argument():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).placement().spill_share_margin == 0.0
    off = pool_config(AppSettings.from_args({"router_spill_needs_share": False}), tenants).placement()
    assert off.spill_share_margin is None and off.idle_slack > 0


def test_the_overloaded_holder_balance_rule_is_an_app_argument_off_by_default():
    from cluster.app import AppSettings, pool_config
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).placement().balance_ratio == 0.0
    on = pool_config(AppSettings.from_args({"router_balance_ratio": 2}), tenants).placement()
    assert on.balance_ratio == 2.0 and on.spill_share_margin == 0.0


def test_the_new_prefix_tie_is_an_app_argument():
    from cluster.app import AppSettings, pool_config
    from policies.placement import PlacementConfig
    from policies.tenancy import Tenants

    tenants = Tenants.from_dict({"tenants": [{"name": "a", "api_keys": ["k"]}]})
    assert pool_config(AppSettings.from_args({}), tenants).placement().place_tie == PlacementConfig().place_tie
    assert pool_config(AppSettings.from_args({"router_place_tie": 1}), tenants).placement().place_tie == 1.0
    assert pool_config(AppSettings.from_args({}), tenants).placement().prefix_fill == 0.9
    assert pool_config(AppSettings.from_args({"router_prefix_fill": 1}), tenants).placement().prefix_fill == 1.0
    with pytest.raises(ValueError, match="router_prefix_fill"):
        AppSettings.from_args({"router_prefix_fill": 0})
    assert pool_config(AppSettings.from_args({}), tenants).placement().remote_ratio == PlacementConfig().remote_ratio
    placed = pool_config(AppSettings.from_args({"router_placement": {"idle_counts_queued": False, "reuse_prior": [8, 8],
                                                                     "remote_ratio": 0}, "router_place_tie": 1}),
                         tenants).placement()
    assert (placed.idle_counts_queued, placed.reuse_prior, placed.remote_ratio, placed.place_tie) == (False, (8, 8), 0, 1.0)
    for bad in ({"no_such_rule": 1}, [1, 2]):
        with pytest.raises(ValueError, match="router_placement"):
            AppSettings.from_args({"router_placement": bad})


@pytest.mark.parametrize("name", ["ray-up-local.yaml", "ray-up-aws-gpu.yaml"])
def test_ray_up_configs_validate(name):
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    validate_config(fillout_defaults(yaml.safe_load((CLUSTER / name).read_text())))
