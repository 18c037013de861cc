//! Where an access-log provider's lines go: the waypoint's `request complete` line (the
//! `envoy` provider without a format in the mesh config), Envoy-formatted lines written
//! to a file (`/dev/stdout` being the process's standard output), or OpenTelemetry log
//! records (`otel_log.rs`).
//!
//! A request never waits on a file: lines go through a bounded queue to one writer
//! thread per path, shared by every config that names the path; a full queue drops
//! the line and counts it (as Envoy's file access log drops when its buffer is full).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};

use http::HeaderName;

use super::format::{Entry, LogFormat};
use super::otel_log::{FinishedLog, OtelLog};

/// Lines waiting for the writer, per file.
const QUEUE: usize = 4096;

/// One access-log provider's output.
#[derive(Debug)]
pub struct Output {
    kind: Kind,
    /// The request and response headers its format reads (every request header when a
    /// `%CEL%` iterates them).
    pub request_headers: Vec<HeaderName>,
    pub response_headers: Vec<HeaderName>,
    pub all_request_headers: bool,
}

#[derive(Debug)]
enum Kind {
    /// The waypoint's own `request complete` line.
    OwnLine,
    /// Envoy-formatted lines to a file.
    File {
        format: LogFormat,
        writer: Arc<FileWriter>,
    },
    /// OpenTelemetry log records to a collector.
    Otel(OtelLog),
}

impl Output {
    /// The waypoint's own line (the default, as before there were formats).
    pub fn own_line() -> Arc<Output> {
        static OWN: OnceLock<Arc<Output>> = OnceLock::new();
        OWN.get_or_init(|| {
            Arc::new(Output {
                kind: Kind::OwnLine,
                request_headers: Vec::new(),
                response_headers: Vec::new(),
                all_request_headers: false,
            })
        })
        .clone()
    }

    /// Envoy-formatted lines to `path`.
    pub fn formatted(format: LogFormat, path: &str) -> Output {
        let (mut request_headers, mut response_headers) = (Vec::new(), Vec::new());
        format.headers(&mut request_headers, &mut response_headers);
        let all_request_headers = format.all_headers();
        Output {
            all_request_headers,
            kind: Kind::File {
                format,
                writer: FileWriter::for_path(Path::new(path)),
            },
            request_headers,
            response_headers,
        }
    }

    /// OpenTelemetry log records.
    pub fn otel(log: OtelLog) -> Output {
        let (mut request_headers, mut response_headers) = (Vec::new(), Vec::new());
        log.headers(&mut request_headers, &mut response_headers);
        Output {
            all_request_headers: log.all_headers(),
            kind: Kind::Otel(log),
            request_headers,
            response_headers,
        }
    }

    pub fn is_own_line(&self) -> bool {
        matches!(self.kind, Kind::OwnLine)
    }

    /// A file output's format.
    pub fn format(&self) -> Option<&LogFormat> {
        match &self.kind {
            Kind::File { format, .. } => Some(format),
            _ => None,
        }
    }

    pub fn otel_log(&self) -> Option<&OtelLog> {
        match &self.kind {
            Kind::Otel(o) => Some(o),
            _ => None,
        }
    }

    /// Writes one request's line to a file output; an OpenTelemetry output returns its
    /// record, for the waypoint's export queue.
    pub fn write(&self, e: &Entry<'_>, trace: Option<(Vec<u8>, Vec<u8>)>) -> Option<FinishedLog> {
        match &self.kind {
            Kind::OwnLine => None,
            Kind::File { format, writer } => {
                writer.send(format.render(e));
                None
            }
            Kind::Otel(o) => Some(o.record(e, trace)),
        }
    }
}

/// The writer thread of one path.
#[derive(Debug)]
struct FileWriter {
    path: PathBuf,
    tx: SyncSender<String>,
    dropped: AtomicU64,
}

impl FileWriter {
    fn for_path(path: &Path) -> Arc<FileWriter> {
        static WRITERS: OnceLock<Mutex<HashMap<PathBuf, Arc<FileWriter>>>> = OnceLock::new();
        let mut all = WRITERS
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(w) = all.get(path) {
            return w.clone();
        }
        let (tx, rx) = sync_channel(QUEUE);
        let w = Arc::new(FileWriter {
            path: path.to_path_buf(),
            tx,
            dropped: AtomicU64::new(0),
        });
        let p = path.to_path_buf();
        if let Err(e) = std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || write_lines(&p, rx))
        {
            tracing::warn!(path = %path.display(), error = %e, "access log: no writer thread");
        }
        all.insert(path.to_path_buf(), w.clone());
        w
    }

    fn send(&self, line: String) {
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed);
                // Logged at the first drop and every 10,000th after.
                if n.is_multiple_of(10_000) {
                    tracing::warn!(path = %self.path.display(), dropped = n + 1, "access log: lines dropped, the writer is behind");
                }
            }
        }
    }
}

/// The writer thread: appends each line, flushing when the queue is empty.
fn write_lines(path: &Path, rx: Receiver<String>) {
    let mut out: Box<dyn Write> = if path == Path::new("/dev/stdout") {
        Box::new(std::io::stdout())
    } else {
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            Ok(f) => Box::new(std::io::BufWriter::new(f)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "access log: cannot open the file; its lines are dropped");
                // Keep receiving so senders see a full queue, not a panic.
                while rx.recv().is_ok() {}
                return;
            }
        }
    };
    while let Ok(line) = rx.recv() {
        let mut r = out.write_all(line.as_bytes());
        while let Ok(more) = rx.try_recv() {
            r = r.and_then(|()| out.write_all(more.as_bytes()));
        }
        if let Err(e) = r.and_then(|()| out.flush()) {
            tracing::warn!(path = %path.display(), error = %e, "access log: write failed");
        }
    }
}
