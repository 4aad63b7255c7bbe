//! Shard-id test vectors: `testdata/shard-ids.txt` holds lines
//! `entity_id number_of_shards shard` (ids without spaces; `#` comments).
//! Any implementation of the shard-id hash (xxh3-64, seed 0, over the id's
//! UTF-8 bytes, modulo the number of shards) in any process, language or
//! release must reproduce them.
//!
//! Regenerate (only when deliberately changing the id set, never the hash):
//! `SHARDLINE_REGEN_SHARD_IDS=1 cargo test -p shardline-core --test shard_ids`.

use std::path::PathBuf;

use shardline_core::sharding::{shard_id_of, SHARD_ID_HASH_NAME};
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/shard-ids.txt")
}

fn ids() -> Vec<String> {
    let mut v: Vec<String> = [
        "a",
        "0",
        "counter-1",
        "user:42",
        "ärger",
        "日本",
        "x".repeat(255).as_str(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend((0..40).map(|i| format!("entity-{i}")));
    v.extend((0..10).map(|i| format!("{}", 1000 + i * 7919)));
    v
}

#[test]
fn xxh3_reference_value() {
    // XXH3_64bits("") with seed 0, from the xxHash reference sanity checks.
    assert_eq!(xxh3_64_with_seed(b"", 0), 0x2D06_8005_38D3_94C2);
    assert_eq!(SHARD_ID_HASH_NAME, "xxh3-64-seed0-mod");
}

#[test]
fn shard_ids_match_the_test_vectors() {
    if std::env::var_os("SHARDLINE_REGEN_SHARD_IDS").is_some() {
        let mut out = String::from(
            "# entity_id number_of_shards shard\n# shard = xxh3_64(seed 0, UTF-8 bytes of entity_id) % number_of_shards\n",
        );
        for id in ids() {
            for n in [1u32, 10, 100, 1000, 65_536] {
                out.push_str(&format!("{id} {n} {}\n", shard_id_of(&id, n).0));
            }
        }
        std::fs::write(path(), out).expect("write test vectors");
    }
    let text = std::fs::read_to_string(path()).expect("testdata/shard-ids.txt");
    let mut checked = 0;
    for (no, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 3, "line {}: {line}", no + 1);
        let n: u32 = f[1].parse().expect("number_of_shards");
        let want: u32 = f[2].parse().expect("shard");
        assert_eq!(shard_id_of(f[0], n).0, want, "line {}: {line}", no + 1);
        checked += 1;
    }
    assert!(checked >= 250, "only {checked} vectors");
}
