//! End-to-end tests of the `sluice-stage` binary: start it on a temporary
//! socket and ephemeral ports, talk to it as trainers and operators would,
//! and check what they see.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sluice_stage::{PlanSpec, Request, TO_END};
use sluice_tests::eventually_blocking;

/// How long a test waits for the stage to get somewhere.
const WAIT: Duration = Duration::from_secs(10);

struct Stage {
    child: Child,
    socket: PathBuf,
    metrics: String,
    _dir: tempfile::TempDir,
}

fn stage_bin() -> PathBuf {
    sluice_tests::binary("sluice-stage")
}

/// A dataset of `n` files whose bytes are a function of their index.
fn dataset(root: &Path, n: usize) {
    for i in 0..n {
        let path = root.join(name(i));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content(i)).unwrap();
    }
}

fn name(i: usize) -> String {
    format!("d{}/{i:04}.bin", i % 3)
}

/// The stage's listing: every file, sorted by name.
fn listing(n: usize) -> Vec<String> {
    let mut names: Vec<String> = (0..n).map(name).collect();
    names.sort();
    names
}

fn content(i: usize) -> Vec<u8> {
    (0..(i * 997) % 20_000 + 1)
        .map(|j| ((i * 31 + j * 7) % 251) as u8)
        .collect()
}

impl Stage {
    fn start(files: usize, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        dataset(&data, files);
        let socket = dir.path().join("stage.sock");
        let mut child = Command::new(stage_bin())
            .args([
                "--socket",
                socket.to_str().unwrap(),
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .arg("--dataset")
            .arg(format!("train={}", data.display()))
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let ready: serde_json::Value = serde_json::from_str(&line).expect("a JSON ready line");
        assert_eq!(ready["event"], "ready");
        let metrics = ready["metrics"].as_str().unwrap().to_owned();
        Self {
            child,
            socket,
            metrics,
            _dir: dir,
        }
    }

    fn connect(&self) -> UnixStream {
        let s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn http_get(&self, path: &str) -> String {
        let mut s = TcpStream::connect(&self.metrics).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        eventually_blocking(
            "the stage to exit after SIGTERM",
            Duration::from_secs(10),
            || self.child.try_wait().unwrap(),
        )
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one frame: (type, payload).
fn read_frame(s: &mut UnixStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body)?;
    Ok((body[0], body[1..].to_vec()))
}

fn request(s: &mut UnixStream, r: &Request) -> (u8, Vec<u8>) {
    s.write_all(&r.encode()).unwrap();
    read_frame(s).unwrap()
}

fn hello(job: &str) -> Request {
    Request::Hello {
        version: 1,
        job: job.into(),
        labels: Default::default(),
        rank: 0,
        world_size: 1,
        features: 0,
    }
}

fn open(dataset: &str) -> Request {
    Request::Open {
        dataset: dataset.into(),
    }
}

fn error_code(frame: &(u8, Vec<u8>)) -> u16 {
    assert_eq!(
        frame.0, 0xEE,
        "expected an ERROR frame, got type {:#x}",
        frame.0
    );
    u16::from_be_bytes([frame.1[0], frame.1[1]])
}

/// Runs a whole epoch as a well-behaved trainer and checks every byte.
fn good_epoch(stage: &Stage, job: &str, files: usize) {
    let mut s = stage.connect();
    assert_eq!(request(&mut s, &hello(job)).0, 0x81);
    assert_eq!(request(&mut s, &open("train")).0, 0x82);
    let order: Vec<u32> = (0..files as u32).rev().collect();
    let planned = request(
        &mut s,
        &Request::Plan {
            epoch: 0,
            spec: PlanSpec::Indices(order.clone()),
            run: None,
        },
    );
    assert_eq!(planned.0, 0x84);
    let (mut seen, mut end) = (0, false);
    while !end {
        let (kind, p) = request(&mut s, &Request::Next { max_samples: 7 });
        assert_eq!(kind, 0x85);
        end = p[0] == 1;
        let count = u32::from_be_bytes(p[1..5].try_into().unwrap());
        let mut at = 5;
        for _ in 0..count {
            let position = u32::from_be_bytes(p[at..at + 4].try_into().unwrap()) as usize;
            let name_len = u16::from_be_bytes([p[at + 4], p[at + 5]]) as usize;
            let name = std::str::from_utf8(&p[at + 6..at + 6 + name_len])
                .unwrap()
                .to_owned();
            at += 6 + name_len;
            assert_eq!(p[at], 0, "sample {name} failed");
            let len = u32::from_be_bytes(p[at + 1..at + 5].try_into().unwrap()) as usize;
            let data = &p[at + 5..at + 5 + len];
            at += 5 + len;
            assert_eq!(position, seen, "delivered in plan order");
            assert_eq!(name, listing(files)[order[position] as usize]);
            let index: usize = name.rsplit('/').next().unwrap()[..4].parse().unwrap();
            assert_eq!(data, content(index), "bytes of {name}");
            seen += 1;
        }
    }
    assert_eq!(seen, files);
    assert_eq!(request(&mut s, &Request::Bye).0, 0x87);
}

#[test]
fn serves_an_epoch_exposes_metrics_and_exits_cleanly_on_sigterm() {
    let stage = Stage::start(60, &[]);
    good_epoch(&stage, "e2e", 60);
    assert!(stage.http_get("/healthz").contains("ok"));
    let metrics = stage.http_get("/metrics");
    for series in [
        r#"sluice_stage_delivered_samples_total{dataset="train",job="e2e"} 60"#,
        "sluice_stage_memory_budget_bytes 1073741824",
        r#"sluice_stage_read_latency_seconds_count{dataset="train",job="e2e"}"#,
    ] {
        assert!(
            metrics.contains(series),
            "/metrics lacks {series}:\n{metrics}"
        );
    }
    let jobs = stage.http_get("/api/v1/jobs");
    assert!(
        jobs.contains(r#""job":"e2e""#) && jobs.contains(r#""delivered_samples":60"#),
        "{jobs}"
    );
    let socket = stage.socket.clone();
    assert!(stage.terminate().success());
    assert!(!socket.exists(), "the socket file is removed on shutdown");
}

#[test]
fn garbage_ends_only_the_offending_connection() {
    let stage = Stage::start(40, &[]);
    let good = std::thread::scope(|scope| {
        let good = scope.spawn(|| good_epoch(&stage, "good", 40));
        // A length prefix far over the limit.
        let mut s = stage.connect();
        s.write_all(&[0xff, 0xff, 0xff, 0xff, 1]).unwrap();
        assert_eq!(error_code(&read_frame(&mut s).unwrap()), 2);
        assert!(
            read_frame(&mut s).is_err(),
            "the connection is closed after a fatal error"
        );
        // A request before HELLO.
        let mut s = stage.connect();
        assert_eq!(
            error_code(&request(&mut s, &Request::Next { max_samples: 1 })),
            4
        );
        // An unknown frame type.
        let mut s = stage.connect();
        s.write_all(&[0, 0, 0, 3, 0x42, 1, 2]).unwrap();
        assert_eq!(error_code(&read_frame(&mut s).unwrap()), 1);
        // Random bytes, then a truncated frame and a hang-up.
        let mut s = stage.connect();
        s.write_all(&[0, 0, 0, 9, 1, 0, 1, 0xde, 0xad, 0xbe, 0xef, 0, 0])
            .unwrap();
        assert_eq!(error_code(&read_frame(&mut s).unwrap()), 1);
        let mut s = stage.connect();
        s.write_all(&[0, 0, 1, 0, 1, 2, 3]).unwrap();
        drop(s);
        // Bad values are answered, and the connection goes on.
        let mut s = stage.connect();
        let bad_rank = Request::Hello {
            version: 1,
            job: "x".into(),
            labels: Default::default(),
            rank: 2,
            world_size: 2,
            features: 0,
        };
        assert_eq!(error_code(&request(&mut s, &bad_rank)), 5);
        assert_eq!(request(&mut s, &hello("x")).0, 0x81);
        assert_eq!(error_code(&request(&mut s, &open("nope"))), 10);
        assert_eq!(request(&mut s, &open("train")).0, 0x82);
        let escape = Request::Read {
            name: "../../etc/passwd".into(),
            offset: 0,
            length: TO_END,
        };
        assert_eq!(error_code(&request(&mut s, &escape)), 13);
        let missing = Request::Read {
            name: "d0/9999.bin".into(),
            offset: 0,
            length: TO_END,
        };
        assert_eq!(error_code(&request(&mut s, &missing)), 12);
        let bad_plan = Request::Plan {
            epoch: 0,
            spec: PlanSpec::Indices(vec![0, 40]),
            run: None,
        };
        assert_eq!(error_code(&request(&mut s, &bad_plan)), 15);
        assert_eq!(
            error_code(&request(&mut s, &Request::Next { max_samples: 1 })),
            17
        );
        let wrong_version = Request::Hello {
            version: 9,
            job: "x".into(),
            labels: Default::default(),
            rank: 0,
            world_size: 1,
            features: 0,
        };
        let mut s = stage.connect();
        assert_eq!(error_code(&request(&mut s, &wrong_version)), 3);
        good.join()
    });
    good.expect("the well-behaved trainer finished its epoch");
    // And the stage still serves newcomers.
    good_epoch(&stage, "later", 40);
    let metrics = stage.http_get("/metrics");
    assert!(
        metrics.contains(r#"sluice_stage_protocol_errors_total{code="frame_too_large"} 1"#),
        "{metrics}"
    );
}

#[test]
fn invalid_configuration_exits_64_with_a_sentence() {
    let out = Command::new(stage_bin())
        .args([
            "--dataset",
            "a=/tmp",
            "--memory-budget",
            "10kB",
            "--socket",
            "/tmp/unused.sock",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("too small"));
    let out = Command::new(stage_bin())
        .args([
            "--dataset",
            "a=/definitely/not/here",
            "--metrics-addr",
            "127.0.0.1:0",
            "--socket",
        ])
        .arg(std::env::temp_dir().join(format!("sluice-e2e-{}.sock", std::process::id())))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/definitely/not/here"));
    // A flag whose value does not parse is one too, as in the YAML file.
    let out = Command::new(stage_bin())
        .args(["--dataset", "a=/tmp", "--rate-limit", "100K/s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ambiguous"));
}

#[test]
fn a_second_stage_cannot_steal_a_live_socket() {
    let stage = Stage::start(3, &[]);
    let out = Command::new(stage_bin())
        .args([
            "--dataset",
            "a=/tmp",
            "--metrics-addr",
            "127.0.0.1:0",
            "--socket",
            stage.socket.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already serving"));
    good_epoch(&stage, "still-here", 3);
}

fn memory_used(stage: &Stage) -> u64 {
    let metrics = stage.http_get("/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("sluice_stage_memory_used_bytes "))
        .expect("memory gauge exported");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_consumer_that_leaves_mid_epoch_frees_its_buffer() {
    let stage = Stage::start(
        200,
        &["--memory-budget", "2MiB", "--initial-buffer", "2MiB"],
    );
    let mut s = stage.connect();
    assert_eq!(request(&mut s, &hello("leaver")).0, 0x81);
    assert_eq!(request(&mut s, &open("train")).0, 0x82);
    let plan = Request::Plan {
        epoch: 0,
        spec: PlanSpec::Indices((0..200).collect()),
        run: None,
    };
    assert_eq!(request(&mut s, &plan).0, 0x84);
    assert_eq!(request(&mut s, &Request::Next { max_samples: 1 }).0, 0x85);
    // The readers fill the buffer ahead of the consumer, up to the budget.
    eventually_blocking("the buffer to fill", WAIT, || {
        (memory_used(&stage) > 1 << 20).then_some(())
    });
    assert!(memory_used(&stage) <= 2 << 20, "the node budget holds");
    drop(s);
    eventually_blocking("the buffer to be freed", WAIT, || {
        (memory_used(&stage) == 0).then_some(())
    });
    // The job is still served afterwards.
    good_epoch(&stage, "leaver", 200);
}
