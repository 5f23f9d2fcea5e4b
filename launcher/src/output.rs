//! Forwarding a rank's output, line by line, optionally prefixed with `[rank]`.

use std::io::Write;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// Writes to a standard stream without ever panicking: the launcher's stdout or stderr
/// may be a pipe whose reader has gone (`ductile run ... 2>&1 | head`), and a message it
/// cannot print must not end the controller before it has ended the job and cleaned up.
#[doc(hidden)]
#[macro_export]
macro_rules! __say {
    ($stream:expr, $how:ident, $($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = $how!($stream, $($arg)*);
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
#[derive(Clone, Copy, Debug)]
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

/// Copies `from` to the agent's `to` stream a line at a time (so lines of different
/// ranks never interleave mid-line, unless longer than [`MAX_PIECE`]), with `prefix`
/// before each line.
pub async fn forward(from: impl AsyncRead + Unpin, prefix: Option<String>, to: Stream) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::with_capacity(256);
    let mut mid_line = false;
    loop {
        line.clear();
        match (&mut reader).take(MAX_PIECE as u64).read_until(b'\n', &mut line).await {
            Ok(0) => {
                if mid_line {
                    let _ = write_to(to, b"\n");
                }
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("output forwarding stopped: {e}");
                return;
            }
        }
        let mut out = Vec::with_capacity(line.len() + 16);
        if let Some(p) = prefix.as_ref().filter(|_| !mid_line) {
            out.extend_from_slice(p.as_bytes());
        }
        out.extend_from_slice(&line);
        let whole = line.ends_with(b"\n");
        if !whole && line.len() < MAX_PIECE {
            // The last line of a process that ended mid-line stays a line of its own.
            out.push(b'\n');
        }
        mid_line = !whole && line.len() == MAX_PIECE;
        // A closed stdout (e.g. `| head`) must not stop the job; drop the output.
        let _ = write_to(to, &out);
    }
}

fn write_to(to: Stream, bytes: &[u8]) -> std::io::Result<()> {
    match to {
        Stream::Stdout => std::io::stdout().lock().write_all(bytes),
        Stream::Stderr => std::io::stderr().lock().write_all(bytes),
    }
}
