//! Unit tests of [`OffloadConfig::from_map`]: budgets, modes, layouts, and every bad value
//! named in its error.
#![allow(clippy::unwrap_used)]

use super::*;

fn parse(pairs: &[(&str, ConfigValue)], world: u32) -> Result<ParsedConfig, ConfigError> {
    let map = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    OffloadConfig::from_map(&map, world)
}

#[test]
fn defaults_split_eight_gib_over_ranks() {
    let p = parse(&[], 4).unwrap();
    assert_eq!(p.config.cpu_bytes_per_rank, 2 << 30);
    assert!(!p.config.lazy_offload);
    assert_eq!(p.config.world_size, 4);
}

#[test]
fn per_rank_wins_and_warns_on_disagreement() {
    let p = parse(
        &[
            (KEY_CPU_BYTES, ConfigValue::Int(1000)),
            (KEY_CPU_BYTES_PER_RANK, ConfigValue::Int(300)),
        ],
        2,
    )
    .unwrap();
    assert_eq!(p.config.cpu_bytes_per_rank, 300);
    assert_eq!(p.warnings.len(), 1);
    assert!(p.warnings[0].contains(KEY_CPU_BYTES_PER_RANK));
}

#[test]
fn agreeing_budgets_do_not_warn() {
    let p = parse(
        &[
            (KEY_CPU_BYTES, ConfigValue::Int(1000)),
            (KEY_CPU_BYTES_PER_RANK, ConfigValue::Int(500)),
        ],
        2,
    )
    .unwrap();
    assert!(p.warnings.is_empty());
}

#[test]
fn integral_floats_and_digit_strings_are_bytes() {
    let p = parse(&[(KEY_CPU_BYTES, ConfigValue::Float(6.4e10))], 1).unwrap();
    assert_eq!(p.config.cpu_bytes_per_rank, 64_000_000_000);
    let p = parse(&[(KEY_CPU_BYTES, ConfigValue::Str("1_000".into()))], 1).unwrap();
    assert_eq!(p.config.cpu_bytes_per_rank, 1000);
}

#[test]
fn every_bad_byte_value_names_key_and_value() {
    let bad = [
        ConfigValue::Int(-5),
        ConfigValue::Int(0),
        ConfigValue::Float(1.5),
        ConfigValue::Float(f64::NAN),
        ConfigValue::Str("abc".into()),
        ConfigValue::Bool(true),
        ConfigValue::Other("dict".into()),
        ConfigValue::List(vec![ConfigValue::Int(1)]),
        ConfigValue::Int(i128::from(u64::MAX) + 1),
    ];
    for key in [KEY_CPU_BYTES, KEY_CPU_BYTES_PER_RANK] {
        for v in &bad {
            let err = parse(&[(key, v.clone())], 1).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(key), "{msg}");
            let shown = match v {
                ConfigValue::Other(t) => t.clone(),
                ConfigValue::Str(s) => s.clone(),
                ConfigValue::Float(f) => f.to_string(),
                ConfigValue::Int(i) => i.to_string(),
                ConfigValue::Bool(b) => b.to_string(),
                ConfigValue::List(_) => "list".to_string(),
                ConfigValue::Null => unreachable!(),
            };
            assert!(msg.contains(&shown), "{msg} lacks {shown}");
        }
    }
}

#[test]
fn bad_lazy_values_name_the_key() {
    for v in [
        ConfigValue::Int(1),
        ConfigValue::Str("yes".into()),
        ConfigValue::Other("dict".into()),
    ] {
        let msg = parse(&[(KEY_LAZY, v)], 1).unwrap_err().to_string();
        assert!(msg.contains(KEY_LAZY), "{msg}");
    }
    assert!(
        parse(&[(KEY_LAZY, ConfigValue::Str("TRUE".into()))], 1)
            .unwrap()
            .config
            .lazy_offload
    );
}

#[test]
fn load_mode_parses_and_rejects_other_values() {
    let mode = |v| parse(&[(KEY_LOAD_MODE, v)], 1).map(|p| p.config.load_mode);
    assert_eq!(parse(&[], 1).unwrap().config.load_mode, LoadMode::Auto);
    assert_eq!(
        mode(ConfigValue::Str("Sync".into())).unwrap(),
        LoadMode::Sync
    );
    assert_eq!(
        mode(ConfigValue::Str("async".into())).unwrap(),
        LoadMode::Async
    );
    for bad in [ConfigValue::Str("later".into()), ConfigValue::Bool(true)] {
        let msg = mode(bad).unwrap_err().to_string();
        assert!(msg.contains(KEY_LOAD_MODE), "{msg}");
    }
    assert!(LoadMode::Auto.is_sync(true));
    assert!(!LoadMode::Auto.is_sync(false));
    assert!(LoadMode::Sync.is_sync(false));
    assert!(!LoadMode::Async.is_sync(true));
}

#[test]
fn kv_cache_layout_parses_and_names_bad_values() {
    let layout = |v: &str| {
        parse(&[(KEY_KV_CACHE_LAYOUT, ConfigValue::Str(v.into()))], 1)
            .map(|p| p.config.kv_cache_layout)
    };
    assert_eq!(
        parse(&[], 1).unwrap().config.kv_cache_layout,
        KvCacheLayout::Auto
    );
    assert_eq!(layout("Engine").unwrap(), KvCacheLayout::Engine);
    assert_eq!(
        layout("blnhc").unwrap(),
        KvCacheLayout::Named("BLNHC".into())
    );
    for bad in ["BLNH", "BLNHH", "NHD", ""] {
        let msg = layout(bad).unwrap_err().to_string();
        assert!(msg.contains(KEY_KV_CACHE_LAYOUT), "{msg}");
        assert!(msg.contains(&format!("\"{bad}\"")), "{msg}");
    }
    let msg = parse(&[(KEY_KV_CACHE_LAYOUT, ConfigValue::Int(1))], 1)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(KEY_KV_CACHE_LAYOUT), "{msg}");
}

#[test]
fn fault_spec_is_kept_raw_and_must_be_a_string() {
    let spec = ConfigValue::Str("fail_loads_every=2".into());
    let p = parse(&[(KEY_FAULTS, spec)], 1).unwrap();
    assert_eq!(p.config.faults.as_deref(), Some("fail_loads_every=2"));
    assert_eq!(parse(&[], 1).unwrap().config.faults, None);
    let msg = parse(&[(KEY_FAULTS, ConfigValue::Int(3))], 1)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(KEY_FAULTS), "{msg}");
}

#[test]
fn unknown_keys_warn_but_parse() {
    let p = parse(&[("cpu_bytes", ConfigValue::Int(1))], 1).unwrap();
    assert_eq!(p.warnings.len(), 1);
    assert!(p.warnings[0].contains("cpu_bytes"));
    let p = parse(&[("kvoffload.other", ConfigValue::Int(1))], 1).unwrap();
    assert!(p.warnings.is_empty());
}

#[test]
fn total_too_small_for_world_is_an_error() {
    let msg = parse(&[(KEY_CPU_BYTES, ConfigValue::Int(3))], 4)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(KEY_CPU_BYTES));
}

#[test]
fn world_size_zero_is_rejected() {
    assert!(parse(&[], 0).is_err());
}

#[test]
fn block_count_divides_budget() {
    let c = parse(&[(KEY_CPU_BYTES, ConfigValue::Int(1000))], 1)
        .unwrap()
        .config;
    assert_eq!(c.num_cpu_blocks(300).unwrap(), 3);
    assert_eq!(c.num_cpu_blocks(2000).unwrap(), 0);
    assert!(c.num_cpu_blocks(0).is_err());
}
