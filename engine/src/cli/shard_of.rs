//! `shardline shard-of --shards N ID...`: prints the shard of each entity id,
//! one `ID SHARD` line per id, with the hash every Shardline process uses
//! (xxh3-64, seed 0, over the id's UTF-8 bytes, modulo the number of shards;
//! see `shardline_core::sharding::shard_id_of`). For operators and
//! load-balancer scripts.

use std::io::Write;

use shardline_core::ids::{EntityId, IdError};
use shardline_core::sharding::shard_id_of;

/// Arguments of `shard-of`.
#[derive(Debug, clap::Args)]
pub struct ShardOfArgs {
    /// The cluster's number_of_shards (1 to 2^32-1).
    #[arg(long)]
    pub shards: u32,
    /// Entity ids (1 to 255 bytes of UTF-8 each).
    #[arg(required = true)]
    pub ids: Vec<String>,
}

/// Errors of `shard-of`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardOfError {
    /// `--shards 0`.
    #[error("--shards must be at least 1")]
    ZeroShards,
    /// An id is not a valid entity id.
    #[error("invalid entity id {id:?}: {source}")]
    InvalidId {
        /// The id as given.
        id: String,
        /// Why it is invalid.
        source: IdError,
    },
    /// Writing the output failed.
    #[error("cannot write output: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes `ID SHARD` for each id to `out`.
///
/// # Errors
/// [`ShardOfError::ZeroShards`] for `--shards 0`, [`ShardOfError::InvalidId`]
/// for an empty or over-long id (nothing is printed then), and
/// [`ShardOfError::Io`] when writing fails.
pub fn run(args: &ShardOfArgs, out: &mut impl Write) -> Result<(), ShardOfError> {
    if args.shards == 0 {
        return Err(ShardOfError::ZeroShards);
    }
    for id in &args.ids {
        EntityId::new(id.as_str()).map_err(|source| ShardOfError::InvalidId {
            id: id.clone(),
            source,
        })?;
    }
    for id in &args.ids {
        writeln!(out, "{id} {}", shard_id_of(id, args.shards).0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_one_line_per_id() {
        let args = ShardOfArgs {
            shards: 100,
            ids: vec!["a".into(), "entity-0".into()],
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            format!(
                "a {}\nentity-0 {}\n",
                shard_id_of("a", 100).0,
                shard_id_of("entity-0", 100).0
            )
        );
        assert!(text.starts_with("a 19\n"), "matches testdata/shard-ids.txt");
    }

    #[test]
    fn refuses_bad_input() {
        let mut out = Vec::new();
        let zero = ShardOfArgs {
            shards: 0,
            ids: vec!["a".into()],
        };
        assert!(matches!(
            run(&zero, &mut out),
            Err(ShardOfError::ZeroShards)
        ));
        let empty = ShardOfArgs {
            shards: 3,
            ids: vec!["a".into(), String::new()],
        };
        assert!(matches!(
            run(&empty, &mut out),
            Err(ShardOfError::InvalidId { .. })
        ));
        assert!(out.is_empty());
    }
}
