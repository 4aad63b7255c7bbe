//! Writes a small sample journal (several segments, three persistence ids,
//! a deletion and a snapshot) into the directory given as the first
//! argument. Useful to try `shardline journal verify|inspect DIR` and to
//! seed the fuzzer's corpus.

use shardline_journal::{
    Durability, Journal, JournalOptions, PersistenceId, SequenceNr, WriterEpoch,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: write_sample DIR")?;
    let options = JournalOptions {
        segment_size_bytes: 8192,
        durability: Durability::Always,
        writer_epoch: WriterEpoch(1),
        ..JournalOptions::default()
    };
    let (mut j, _) = Journal::open(&dir, options)?;
    let ids: Vec<PersistenceId> = ["counter|a", "counter|b", "echo|c"]
        .iter()
        .map(|s| PersistenceId::new(s))
        .collect::<Result<_, _>>()?;
    let mut last = None;
    for seq in 1..=60u64 {
        for p in &ids {
            let payload = format!("add {seq}");
            last = Some(j.append(p, SequenceNr(seq), WriterEpoch(1), payload.as_bytes())?);
        }
    }
    j.delete_to(&ids[2], SequenceNr(10), WriterEpoch(1))?;
    j.save_snapshot(&ids[0], SequenceNr(30), WriterEpoch(1), b"value=465")?;
    if let Some(l) = last {
        j.wait_durable(l)?;
    }
    j.close()?;
    println!("wrote a sample journal to {dir}");
    Ok(())
}
