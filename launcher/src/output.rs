//! Forwarding a rank's output, line by line, optionally prefixed with `[rank]`.

use std::io::Write;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// Writes to a standard stream without ever panicking: the launcher's stdout or stderr
/// may be a pipe whose reader has gone (`ductile run ... 2>&1 | head`), and a message it
/// cannot print must not end the controller before it has ended the job and cleaned up.
/// The text is formatted first and written at once: the agents of simulated nodes share
/// the launcher's stderr, which is unbuffered, and a `writeln!` there writes each piece
/// of its format with a system call of its own, so two agents' lines could interleave
/// mid-line (a line up to `PIPE_BUF`, 4 KiB, written at once to a pipe stays whole).
#[doc(hidden)]
#[macro_export]
macro_rules! __say {
    ($stream:expr, write, $($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = $stream.write_all(format!($($arg)*).as_bytes());
    }};
    ($stream:expr, writeln, $($arg:tt)*) => {{
        use std::io::Write as _;
        let mut text = format!($($arg)*);
        text.push('\n');
        let _ = $stream.write_all(text.as_bytes());
    }};
}

/// `eprint!` that never panics (see `__say!`).
#[macro_export]
macro_rules! say_err { ($($arg:tt)*) => { $crate::__say!(std::io::stderr(), write, $($arg)*) }; }

/// `eprintln!` that never panics (see `__say!`).
#[macro_export]
macro_rules! say_errln { ($($arg:tt)*) => { $crate::__say!(std::io::stderr(), writeln, $($arg)*) }; }

/// `print!` that never panics (see `__say!`).
#[macro_export]
macro_rules! say { ($($arg:tt)*) => { $crate::__say!(std::io::stdout(), write, $($arg)*) }; }

/// `println!` that never panics (see `__say!`).
#[macro_export]
macro_rules! sayln { ($($arg:tt)*) => { $crate::__say!(std::io::stdout(), writeln, $($arg)*) }; }

/// Which of the agent's streams to write to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Longest piece of a line held at once: a longer line (a binary dump, a progress bar
/// redrawn with `\r`) goes out in pieces of this size, which other ranks' lines may
/// then come between, instead of taking memory without bound.
const MAX_PIECE: usize = 1 << 20;

/// Where a rank's output goes.
#[derive(Clone)]
pub enum Sink {
    /// The agent's own stdout or stderr (shared with the controller on its host).
    Local(Stream),
    /// Messages on the agent's channel to the controller (an agent on another host,
    /// whose stdout carries its channel to its spawner): the stream, and the channel.
    Up(Stream, crate::agent::Uplink),
}

/// Copies `from` to `to` a line at a time (so lines of different ranks never
/// interleave mid-line, unless longer than [`MAX_PIECE`]), with `prefix` before each
/// line.
pub async fn forward(from: impl AsyncRead + Unpin, prefix: Option<String>, to: Sink) {
    forward_pieces(from, prefix, MAX_PIECE, |b| {
        let to = to.clone();
        async move {
            match to {
                // A closed stdout (e.g. `| head`) must not stop the job; the output is
                // dropped.
                Sink::Local(s) => {
                    let _ = write_to(s, &b);
                }
                Sink::Up(s, up) => up.output(s, b).await,
            }
        }
    })
    .await;
}

/// [`forward`] into `out`, one call per line or piece of at most `max` bytes.
async fn forward_pieces<F: std::future::Future<Output = ()>>(
    from: impl AsyncRead + Unpin,
    prefix: Option<String>,
    max: usize,
    mut out: impl FnMut(Vec<u8>) -> F,
) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::with_capacity(256);
    let mut mid_line = false;
    loop {
        line.clear();
        match (&mut reader).take(max as u64).read_until(b'\n', &mut line).await {
            Ok(0) => {
                if mid_line {
                    out(b"\n".to_vec()).await;
                }
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("output forwarding stopped: {e}");
                return;
            }
        }
        let mut piece = Vec::with_capacity(line.len() + 16);
        if let Some(p) = prefix.as_ref().filter(|_| !mid_line) {
            piece.extend_from_slice(p.as_bytes());
        }
        piece.extend_from_slice(&line);
        let whole = line.ends_with(b"\n");
        if !whole && line.len() < max {
            // The last line of a process that ended mid-line stays a line of its own.
            piece.push(b'\n');
        }
        mid_line = !whole && line.len() == max;
        out(piece).await;
    }
}

/// What the printer thread does.
enum Print {
    /// Write these bytes to this stream.
    Write(Stream, Vec<u8>),
    /// Say when everything before has been written.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// Pieces of output queued for the printer at most: a stdout that does not drain (a
/// paused pager) then holds up the agents that send more, through their connections,
/// not the controller's event loop.
const PRINT_QUEUE: usize = 256;

/// The printer: a thread that writes the output of ranks on other hosts (it arrives
/// as messages on the controller's channels), so that a blocked stdout never blocks
/// the controller itself.
fn printer() -> &'static tokio::sync::mpsc::Sender<Print> {
    static PRINTER: std::sync::OnceLock<tokio::sync::mpsc::Sender<Print>> = std::sync::OnceLock::new();
    PRINTER.get_or_init(|| {
        let (tx, mut rx) = tokio::sync::mpsc::channel(PRINT_QUEUE);
        let spawned = std::thread::Builder::new().name("ductile-printer".into()).spawn(move || {
            while let Some(p) = rx.blocking_recv() {
                match p {
                    Print::Write(s, bytes) => {
                        let _ = write_to(s, &bytes);
                    }
                    Print::Flush(done) => {
                        let _ = std::io::stdout().flush();
                        let _ = std::io::stderr().flush();
                        let _ = done.send(());
                    }
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the output thread ({e}); output from other hosts is lost");
        }
        tx
    })
}

/// Prints a piece of a remote rank's output (waits while the printer's queue is full).
pub async fn print(s: Stream, bytes: Vec<u8>) {
    let _ = printer().send(Print::Write(s, bytes)).await;
}

/// Waits (at most `limit`) until everything [`print()`] was given has been written.
pub async fn printed(limit: std::time::Duration) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let flushed = async {
        if printer().send(Print::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    };
    let _ = tokio::time::timeout(limit, flushed).await;
}

/// Writes `bytes` to this process's `to` stream.
///
/// # Errors
/// The stream is closed.
pub fn write_to(to: Stream, bytes: &[u8]) -> std::io::Result<()> {
    match to {
        Stream::Stdout => std::io::stdout().lock().write_all(bytes),
        Stream::Stderr => std::io::stderr().lock().write_all(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pieces(input: &[u8], max: usize) -> Vec<String> {
        let mut got = Vec::new();
        forward_pieces(input, Some("[3] ".into()), max, |b| {
            got.push(String::from_utf8_lossy(&b).into_owned());
            std::future::ready(())
        })
        .await;
        got
    }

    #[tokio::test]
    async fn long_lines_go_out_in_pieces_prefixed_once() {
        assert_eq!(pieces(b"ab\ncd", 8).await, ["[3] ab\n", "[3] cd\n"]);
        // 10 bytes with its newline: a piece of 4, of 4, then the rest.
        assert_eq!(pieces(b"abcdefghi\nz\n", 4).await, ["[3] abcd", "efgh", "i\n", "[3] z\n"]);
        // A piece that fills the limit at the end of the input still ends its line.
        assert_eq!(pieces(b"abcd", 4).await, ["[3] abcd", "\n"]);
        assert_eq!(pieces(b"abc\n", 4).await, ["[3] abc\n"]);
        assert!(pieces(b"", 4).await.is_empty());
    }
}
