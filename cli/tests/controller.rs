//! The subcommands that talk to the controller, run as the real binary
//! against a fake `AdminService` (see `fake/mod.rs`): what an operator sees
//! on stdout and stderr, the exit code, and what the controller was sent.

mod fake;

use std::fs;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};

mod run;
use fake::FakeController;
use run::Run;
use serde_json::Value;

const POOL: &str = "\
apiVersion: sluice.dev/v1
kind: StoragePool
metadata:
  name: shared-nfs
spec:
  capacity:
    bandwidth: 2GiB/s
";

const POLICY: &str = "\
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata:
  name: vision
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared-nfs
";

/// What one run of the binary left behind.
fn sluicectl_in(dir: &Path, server: &str, args: &[&str], stdin: &str) -> Run {
    let args: Vec<&str> = ["--server", server].iter().chain(args).copied().collect();
    run::sluicectl(dir, &args, stdin)
}

fn sluicectl(server: &str, args: &[&str]) -> Run {
    sluicectl_in(Path::new(env!("CARGO_MANIFEST_DIR")), server, args, "")
}

/// A loopback address where nothing listens: a port the OS just handed
/// out and took back.
fn nobody_listening() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

fn assert_fits_80_columns(text: &str) {
    for line in text.lines() {
        assert!(line.chars().count() <= 80, "{} wide: {line:?}", line.len());
    }
}

#[test]
fn apply_sends_every_file_in_one_request_and_prints_each_change() {
    let fake = FakeController::start();
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("a-pool.yaml"), POOL).unwrap();
    fs::write(dir.path().join("b-policy.yaml"), POLICY).unwrap();

    let run = sluicectl_in(dir.path(), &fake.url, &["apply", "-f", "."], "");

    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.stdout,
        "pool/shared-nfs created (revision 1)\njobpolicy/vision created (revision 1)\n"
    );
    assert_eq!(run.stderr, "");
    let seen = fake.seen();
    assert_eq!(seen.applies.len(), 1);
    let names: Vec<&str> = seen.applies[0]
        .sources
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(names, ["./a-pool.yaml", "./b-policy.yaml"]);
    assert_eq!(seen.applies[0].sources[1].yaml, POLICY);
    assert!(!seen.applies[0].dry_run);
}

#[test]
fn a_dry_run_from_stdin_says_so() {
    let fake = FakeController::start();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = sluicectl_in(here, &fake.url, &["apply", "--dry-run", "-f", "-"], POOL);

    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.stdout,
        "pool/shared-nfs created (revision 1, dry run)\n"
    );
    let seen = fake.seen();
    assert!(seen.applies[0].dry_run);
    assert_eq!(seen.applies[0].sources[0].name, "-");
}

#[test]
fn an_invalid_policy_prints_the_controllers_locations_and_exits_1() {
    let fake = FakeController::start();
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("bad.yaml"),
        POLICY.replace("pool:", "wieght: 3\n  pool:"),
    )
    .unwrap();

    let run = sluicectl_in(dir.path(), &fake.url, &["apply", "-f", "bad.yaml"], "");

    assert_eq!(run.code, 1);
    assert_eq!(run.stdout, "");
    assert_eq!(run.stderr, format!("{}\n", fake::INVALID_LINES));
    for line in run.stderr.lines() {
        let mut parts = line.splitn(4, ':');
        assert_eq!(parts.next(), Some("bad.yaml"));
        assert!(parts.next().unwrap().parse::<u32>().is_ok(), "{line}");
        assert!(parts.next().unwrap().parse::<u32>().is_ok(), "{line}");
    }
}

#[test]
fn get_stages_as_json_has_the_documented_shape() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["get", "stages", "-o", "json"]);

    assert_eq!(run.code, 0, "{}", run.stderr);
    let stages: Value = serde_json::from_str(&run.stdout).unwrap();
    let stages = stages.as_array().expect("a JSON array");
    assert_eq!(stages.len(), 2);
    let a = &stages[0];
    assert_eq!(a["id"], "node-a-0");
    assert_eq!(a["node"], "node-a");
    assert_eq!(a["state"], "connected");
    assert_eq!(a["desired_version"], 3);
    assert_eq!(a["acked_version"], 3);
    assert_eq!(a["in_sync"], true);
    assert_eq!(a["last_nack"], Value::Null);
    assert_eq!(a["labels"]["zone"], "eu-1");
    let b = &stages[1];
    assert_eq!(b["state"], "lost");
    assert_eq!(b["desired_version"], 4);
    assert_eq!(b["acked_version"], 3);
    assert_eq!(b["last_nack"]["version"], 4);
}

#[test]
fn get_policies_as_json_and_yaml() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["get", "policies", "-o", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let policies: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(policies[0]["kind"], "JobPolicy");
    assert_eq!(policies[0]["name"], "vision");
    assert_eq!(policies[0]["revision"], 3);
    assert_eq!(policies[0]["document"]["metadata"]["name"], "vision");
    assert_eq!(policies[1]["kind"], "StoragePool");

    let run = sluicectl(&fake.url, &["get", "policies", "-o", "yaml"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let yaml: Value = serde_yaml_ng::from_str(&run.stdout).unwrap();
    assert_eq!(yaml, policies);
}

#[test]
fn every_get_table_fits_80_columns() {
    let fake = FakeController::start();
    for (what, header) in [
        ("stages", "ID"),
        ("jobs", "ID"),
        ("pools", "NAME"),
        ("policies", "KIND"),
    ] {
        let run = sluicectl(&fake.url, &["get", what]);
        assert_eq!(run.code, 0, "{what}: {}", run.stderr);
        assert!(run.stdout.starts_with(header), "{what}: {}", run.stdout);
        assert_fits_80_columns(&run.stdout);
    }
    let run = sluicectl(&fake.url, &["get", "stages"]);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    assert!(lines[2].contains("  lost  "), "{}", lines[2]);
    assert!(lines[2].contains("nacked"), "{}", lines[2]);
}

#[test]
fn an_unreachable_controller_is_one_line_and_exit_1() {
    let url = nobody_listening();
    for args in [
        &["get", "stages"][..],
        &["get", "jobs", "-o", "json"],
        &["describe", "job", "bert"],
        &["delete", "policy", "vision"],
        &["top", "--once"],
    ] {
        let run = sluicectl(&url, args);
        assert_eq!(run.code, 1, "{args:?}");
        assert_eq!(run.stdout, "", "{args:?}");
        let prefix = format!("sluicectl: cannot reach the controller at {url}: ");
        assert!(run.stderr.starts_with(&prefix), "{args:?}: {}", run.stderr);
        assert_eq!(run.stderr.lines().count(), 1, "{args:?}: {}", run.stderr);
    }

    // The address can come from SLUICE_SERVER too.
    let output = Command::new(env!("CARGO_BIN_EXE_sluicectl"))
        .args(["get", "pools"])
        .env("SLUICE_SERVER", &url)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains(&url));
}

#[test]
fn stage_and_describe_dataset_show_staging_and_cache_use() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["stage", "imagenet"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.stdout,
        "staging round 42 of imagenet asked of node-a-0\n\
         node-a-0: round 42: done, 1000/1000 samples, 100 MiB read from the source\n"
    );
    // The controller out of reach, then a standby, while the round runs:
    // watching goes on (it exited at the first failed poll).
    let run = sluicectl(&fake.url, &["stage", "flaky", "--timeout", "30"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.stderr
            .matches("the round goes on on the stages; still watching")
            .count(),
        1,
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("the controller answers again"),
        "{}",
        run.stderr
    );
    assert!(
        run.stdout.ends_with(
            "node-a-0: round 42: done, 1000/1000 samples, 100 MiB read from the source\n"
        ),
        "{}",
        run.stdout
    );
    let refused = sluicectl(&fake.url, &["stage", "other"]);
    assert_eq!(refused.code, 1);
    assert!(
        refused
            .stderr
            .contains("no DatasetCache policy names data set `other`"),
        "{}",
        refused.stderr
    );
    let run = sluicectl(&fake.url, &["describe", "dataset", "imagenet"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    for line in [
        "Dataset:       imagenet\n",
        "Cache policy:  imagenet-cache\n",
        "  node-a-0 (connected)\n",
        "    Memory:    100 MiB of 1.00 GiB (share 512 MiB)\n",
        "    Hits:      3000 (75.0% of lookups, 300 MiB)\n",
        "    Staging:   round 42: done, 1000/1000 samples, 100 MiB read from the source\n",
    ] {
        assert!(run.stdout.contains(line), "{line:?} in\n{}", run.stdout);
    }
    assert_fits_80_columns(&run.stdout);
}

#[test]
fn get_datasets_lists_each_data_set_and_its_caches() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["get", "datasets"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        run.stdout,
        "NAME      POLICY          STAGES  CACHED   SAMPLES  HITS   STAGING\n\
         imagenet  imagenet-cache  1       100 MiB  1000     75.0%  done\n"
    );
    let run = sluicectl(&fake.url, &["get", "datasets", "-o", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let json: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(json[0]["name"], "imagenet");
    assert_eq!(json[0]["policy"], "imagenet-cache");
    assert_eq!(json[0]["stages"][0]["state"], "connected");
    assert_eq!(json[0]["stages"][0]["cache"]["entries"], 1000);
    assert_eq!(
        json[0]["stages"][0]["cache"]["staging"]["samples_done"],
        1000
    );
}

#[test]
fn describe_shows_one_object_in_detail() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["describe", "job", "resnet50"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.starts_with("Job:        resnet50\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("Policy:     vision\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("  Rate:    800 MiB/s\n"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("  node-a-0  yes"), "{}", run.stdout);
    assert_fits_80_columns(&run.stdout);

    let run = sluicectl(&fake.url, &["describe", "stage", "node-a-0"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("State:        connected\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("Jobs: bert, resnet50\n"),
        "{}",
        run.stdout
    );

    let run = sluicectl(&fake.url, &["describe", "pool", "shared-nfs"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("Capacity:   2.00 GiB/s, 20000 ops/s\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.ends_with(
            "Problems:\n  pool shared-nfs: bandwidth guarantees add up to 2560.0 MiB/s > capacity 2048.0 MiB/s; scaled by 0.8000\n"
        ),
        "{}",
        run.stdout
    );

    let run = sluicectl(&fake.url, &["describe", "job", "nope"]);
    assert_eq!(run.code, 1);
    assert_eq!(run.stderr, "sluicectl: no job `nope`\n");
}

#[test]
fn delete_sends_the_kind_its_subcommand_names() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["delete", "policy", "vision"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    // The fake, like a controller from before responses named the kind,
    // leaves it out for `delete policy`: the word stays `policy`.
    assert_eq!(run.stdout, "policy/vision deleted (revision 2)\n");

    let run = sluicectl(&fake.url, &["delete", "pool", "shared-nfs"]);
    assert_eq!(run.stdout, "pool/shared-nfs deleted (revision 2)\n");

    let run = sluicectl(&fake.url, &["delete", "jobpolicy", "vision"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.stdout, "jobpolicy/vision deleted (revision 2)\n");

    let run = sluicectl(&fake.url, &["delete", "datasetcache", "vision"]);
    assert_eq!(run.stdout, "datasetcache/vision deleted (revision 2)\n");

    let run = sluicectl(&fake.url, &["delete", "policy", "nope"]);
    assert_eq!(run.code, 1);
    assert_eq!(run.stderr, "sluicectl: no policy named `nope`\n");

    let seen = fake.seen();
    let kinds: Vec<&str> = seen.deletes.iter().map(|d| d.kind.as_str()).collect();
    assert_eq!(kinds, ["", "StoragePool", "JobPolicy", "DatasetCache", ""]);
}

#[test]
fn top_once_prints_one_frame_without_escapes() {
    let fake = FakeController::start();
    let run = sluicectl(&fake.url, &["top", "--once"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(!run.stdout.contains('\x1b'), "{:?}", run.stdout);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert!(
        lines[0].starts_with(&format!(
            "sluicectl top  {}  stages: 1 connected, 1 lost",
            fake.url
        )),
        "{}",
        lines[0]
    );
    assert!(lines[2].starts_with("JOB "), "{}", run.stdout);
    let resnet = lines.iter().find(|l| l.starts_with("resnet50")).unwrap();
    for word in ["812 MiB/s", "3.2%", "800 MiB/s", "cap", "1/1"] {
        assert!(resnet.contains(word), "{word} in {resnet}");
    }
    assert!(run.stdout.contains("\nSTAGE "), "{}", run.stdout);
    assert!(run.stdout.contains("3/4"), "{}", run.stdout);
    assert_fits_80_columns(&run.stdout);
}

#[test]
fn top_redraws_until_ctrl_c_and_then_exits_0() {
    use std::io::Read;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    let fake = FakeController::start();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluicectl"))
        .args(["--server", &fake.url, "top"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (chunks, received) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0; 4096];
        while let Ok(n @ 1..) = stdout.read(&mut buf) {
            if chunks.send(buf[..n].to_vec()).is_err() {
                return;
            }
        }
    });

    // Two frames: the view redraws on its own (into a pipe, one after the
    // other, with no terminal control codes).
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while String::from_utf8_lossy(&seen)
        .matches("sluicectl top")
        .count()
        < 2
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match received.recv_timeout(left) {
            Ok(chunk) => seen.extend(chunk),
            Err(_) => panic!("no second frame: {:?}", String::from_utf8_lossy(&seen)),
        }
    }
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(text.contains("resnet50"), "{text:?}");
    assert!(!text.contains('\x1b'), "{text:?}");

    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "top still running after SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}
