//! ARC-format block-access traces (`.lis`, or `.lis.zst` compressed with zstd).
//!
//! Format (from the ARC paper's trace distribution, see
//! `../shared/data/arc/README.md`): one request a line, four
//! space-separated unsigned integers
//! `starting_block number_of_blocks ignored request_number`. A line stands
//! for `number_of_blocks` page references `starting_block ..
//! starting_block + number_of_blocks - 1`, in that order. Blank lines are
//! skipped; any other line that is not four unsigned integers with
//! `number_of_blocks >= 1` is an error naming the file and the line number.
//!
//! Source: N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead
//! Replacement Cache", USENIX FAST '03, pp. 115-130, 2003.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Largest `number_of_blocks` accepted on one line (count). A larger value is
/// treated as a corrupt line rather than expanded.
pub const MAX_BLOCKS_PER_LINE: u64 = 1 << 24;

/// A streaming reader of page references from an ARC trace file.
///
/// Yields one `Ok(page)` per page reference, in trace order, or one `Err`
/// naming `file:line` for the first malformed line (and nothing after it).
pub struct TraceReader {
    path: PathBuf,
    lines: Box<dyn BufRead + Send>,
    line_no: u64,
    buffer: String,
    next_page: u64,
    remaining: u64,
    failed: bool,
}

impl TraceReader {
    /// Opens `path`; a name ending in `.zst` is decompressed with zstd while
    /// reading.
    ///
    /// # Errors
    /// When the file cannot be opened or the zstd stream cannot be started.
    pub fn open(path: &Path) -> Result<TraceReader> {
        let file =
            File::open(path).with_context(|| format!("cannot open trace {}", path.display()))?;
        let lines: Box<dyn BufRead + Send> = if path.extension().is_some_and(|e| e == "zst") {
            let decoder = zstd::stream::read::Decoder::new(file)
                .with_context(|| format!("cannot start zstd decoding of {}", path.display()))?;
            Box::new(BufReader::with_capacity(1 << 16, decoder))
        } else {
            Box::new(BufReader::with_capacity(1 << 16, file))
        };
        Ok(TraceReader::from_reader(path, lines))
    }

    /// Reads a trace from any buffered reader; `path` is used in error
    /// messages only.
    pub fn from_reader(path: &Path, lines: Box<dyn BufRead + Send>) -> TraceReader {
        TraceReader {
            path: path.to_path_buf(),
            lines,
            line_no: 0,
            buffer: String::new(),
            next_page: 0,
            remaining: 0,
            failed: false,
        }
    }

    fn read_line(&mut self) -> Result<bool> {
        loop {
            self.buffer.clear();
            let read = self.lines.read_line(&mut self.buffer).with_context(|| {
                format!("{}:{}: read error", self.path.display(), self.line_no + 1)
            })?;
            if read == 0 {
                return Ok(false);
            }
            self.line_no += 1;
            let line = self.buffer.trim();
            if line.is_empty() {
                continue;
            }
            let (start, count) = parse_line(line).with_context(|| {
                format!(
                    "{}:{}: malformed trace line `{}`",
                    self.path.display(),
                    self.line_no,
                    truncate(line)
                )
            })?;
            self.next_page = start;
            self.remaining = count;
            return Ok(true);
        }
    }
}

fn truncate(line: &str) -> &str {
    match line.char_indices().nth(60) {
        Some((i, _)) => &line[..i],
        None => line,
    }
}

/// Parses one non-blank trace line into `(starting_block, number_of_blocks)`.
///
/// # Errors
/// When the line does not hold exactly four unsigned decimal integers, when
/// `number_of_blocks` is 0 or above [`MAX_BLOCKS_PER_LINE`], or when the range
/// overflows `u64`.
pub fn parse_line(line: &str) -> Result<(u64, u64)> {
    let mut fields = [0u64; 4];
    let mut count = 0;
    for token in line.split_ascii_whitespace() {
        if count == 4 {
            bail!("more than four fields");
        }
        fields[count] = token.parse::<u64>().with_context(|| {
            format!(
                "field {} `{}` is not an unsigned integer",
                count + 1,
                truncate(token)
            )
        })?;
        count += 1;
    }
    if count != 4 {
        bail!("expected four fields (starting_block number_of_blocks ignored request_number), found {count}");
    }
    let (start, blocks) = (fields[0], fields[1]);
    if blocks == 0 || blocks > MAX_BLOCKS_PER_LINE {
        bail!("number_of_blocks {blocks} is outside 1..={MAX_BLOCKS_PER_LINE}");
    }
    if start.checked_add(blocks - 1).is_none() {
        bail!("block range overflows");
    }
    Ok((start, blocks))
}

impl Iterator for TraceReader {
    type Item = Result<u64>;

    fn next(&mut self) -> Option<Result<u64>> {
        if self.failed {
            return None;
        }
        if self.remaining == 0 {
            match self.read_line() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(error) => {
                    self.failed = true;
                    return Some(Err(error));
                }
            }
        }
        let page = self.next_page;
        self.next_page += 1;
        self.remaining -= 1;
        Some(Ok(page))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn reader(text: &str) -> TraceReader {
        TraceReader::from_reader(
            Path::new("t.lis"),
            Box::new(Cursor::new(text.as_bytes().to_vec())),
        )
    }

    #[test]
    fn lines_expand_to_page_references() {
        let pages: Vec<u64> = reader("5 1 0 0\n10 3 0 1\n\n7 1 0 2\n")
            .map(|p| p.unwrap())
            .collect();
        assert_eq!(pages, vec![5, 10, 11, 12, 7]);
    }

    #[test]
    fn malformed_line_names_file_and_line() {
        let items: Vec<_> = reader("1 1 0 0\n2 1 0 1\n3 x 0 2\n4 1 0 3\n").collect();
        assert_eq!(items.len(), 3);
        assert_eq!(*items[0].as_ref().unwrap(), 1);
        let error = format!("{:#}", items[2].as_ref().unwrap_err());
        assert!(error.contains("t.lis:3"), "{error}");
        assert!(error.contains("not an unsigned integer"), "{error}");
    }

    #[test]
    fn wrong_field_counts_and_bad_ranges_are_refused() {
        assert!(parse_line("1 1 0").is_err());
        assert!(parse_line("1 1 0 0 9").is_err());
        assert!(parse_line("1 0 0 0").is_err());
        assert!(parse_line("-1 1 0 0").is_err());
        assert!(parse_line(&format!("{} 2 0 0", u64::MAX)).is_err());
        assert!(parse_line(&format!("1 {} 0 0", MAX_BLOCKS_PER_LINE + 1)).is_err());
        assert_eq!(parse_line("  42   2 0 7 ").unwrap(), (42, 2));
    }

    #[test]
    fn compressed_traces_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.lis.zst");
        let compressed = zstd::encode_all(Cursor::new(b"3 1 0 0\n9 2 0 1\n".to_vec()), 3).unwrap();
        std::fs::write(&path, compressed).unwrap();
        let pages: Vec<u64> = TraceReader::open(&path)
            .unwrap()
            .map(|p| p.unwrap())
            .collect();
        assert_eq!(pages, vec![3, 9, 10]);
    }

    #[test]
    fn bad_line_in_compressed_file_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.lis.zst");
        let compressed = zstd::encode_all(Cursor::new(b"3 1 0 0\nhello\n".to_vec()), 3).unwrap();
        std::fs::write(&path, compressed).unwrap();
        let error = TraceReader::open(&path)
            .unwrap()
            .find_map(|p| p.err())
            .unwrap();
        let text = format!("{error:#}");
        assert!(text.contains("bad.lis.zst:2"), "{text}");
    }
}
