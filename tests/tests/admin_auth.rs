//! Admin authentication, end to end with the real binaries: bearer tokens
//! from `--token-file` guard the gRPC admin API and the REST API (no or
//! unknown token: UNAUTHENTICATED / 401; a read token on a change:
//! PERMISSION_DENIED / 403, and nothing changes), probes and metrics stay
//! open, `sluicectl` sends `--token` and `SLUICE_TOKEN`, tokens rotate by
//! editing the file, and a controller without tokens refuses to listen
//! beyond loopback unless told `--insecure-admin`.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use sluice_proto::AdminServiceClient;
use sluice_proto::v1::{
    ApplyPoliciesRequest, DeletePolicyRequest, ListPoliciesRequest, ListStagesRequest, Policy,
    PolicySource,
};
use support::{
    admin, controller_command, controller_command_at, eventually, http_with, policy, start,
};
use tonic::transport::Channel;
use tonic::{Code, Request};

const ADMIN: &str = "admin-0123456789abcdef";
const READ: &str = "read-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(30);

/// Writes a token file with an admin and a read token.
fn token_file(dir: &Path, admin: &str) -> PathBuf {
    let path = dir.join("tokens");
    std::fs::write(
        &path,
        format!("# test tokens\nadmin {admin}\nread  {READ}\n"),
    )
    .unwrap();
    path
}

/// Returns `message` as a request carrying `token`, if any.
fn with<T>(message: T, token: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

fn apply_request(yaml: &str) -> ApplyPoliciesRequest {
    ApplyPoliciesRequest {
        sources: vec![PolicySource {
            name: "p.yaml".into(),
            yaml: yaml.into(),
        }],
        dry_run: false,
    }
}

/// Every policy revision, as a read token sees them.
async fn policies(client: &AdminServiceClient<Channel>) -> Vec<Policy> {
    let request = with(
        ListPoliciesRequest {
            include_history: true,
        },
        Some(READ),
    );
    let list = client.clone().list_policies(request).await.unwrap();
    list.into_inner().policies
}

/// Returns the code of a failed call.
fn code<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> (Code, String) {
    let status = result.unwrap_err();
    (status.code(), status.message().to_owned())
}

/// Returns the HTTP status line and the body of a response.
fn status_and_body(response: &str) -> (&str, &str) {
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap(), body)
}

fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_guard_grpc_and_http_and_refusals_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(dir.path(), ADMIN);
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    let mut command = controller_command(&url);
    command.arg(format!("--token-file={}", tokens.display()));
    let (_controller, ready) = start(command, &dir.path().join("c.log"));
    let (grpc, addr) = (
        ready["grpc"].as_str().unwrap(),
        ready["http"].as_str().unwrap(),
    );
    let client = admin(grpc).await;
    let mut c = client.clone();
    c.apply_policies(with(apply_request(&policy("100MB/s")), Some(ADMIN)))
        .await
        .unwrap();
    let before = policies(&client).await;
    assert_eq!(before.len(), 2);

    // gRPC: no token, an unknown one, a read token on changes.
    let changed = policy("50MB/s");
    let refused = [
        (None, Code::Unauthenticated, "a bearer token is required"),
        (
            Some("not-a-token-0123456789"),
            Code::Unauthenticated,
            "not one this controller accepts",
        ),
        (
            Some(READ),
            Code::PermissionDenied,
            "the token is read-only: ApplyPolicies needs an admin token",
        ),
    ];
    for (token, expected, message) in refused {
        let (got, text) = code(c.apply_policies(with(apply_request(&changed), token)).await);
        assert_eq!(
            (got, text.contains(message)),
            (expected, true),
            "{token:?}: {text}"
        );
    }
    let delete = DeletePolicyRequest {
        kind: "JobPolicy".into(),
        name: "vision".into(),
    };
    let (got, _) = code(c.delete_policy(with(delete, Some(READ))).await);
    assert_eq!(got, Code::PermissionDenied);
    let (got, _) = code(
        c.list_policies(with(ListPoliciesRequest::default(), None))
            .await,
    );
    assert_eq!(got, Code::Unauthenticated);

    // HTTP: 401 without a (valid) token, 403 for a read token on a change.
    let get = |headers: &str| http_with(addr, "GET", "/api/v1/policies", headers, "");
    let post = |headers: &str| http_with(addr, "POST", "/api/v1/policies", headers, &changed);
    for response in [get(""), get(&bearer("wrong-0123456789abcdef")), post("")] {
        let (line, body) = status_and_body(&response);
        assert_eq!(line, "HTTP/1.1 401 Unauthorized", "{response}");
        assert!(response.contains("www-authenticate: Bearer"), "{response}");
        assert_eq!(body.lines().count(), 1, "{response}");
    }
    let response = post(&bearer(READ));
    assert_eq!(
        status_and_body(&response),
        (
            "HTTP/1.1 403 Forbidden",
            "the token is read-only: POST /api/v1/policies needs an admin token\n"
        )
    );
    assert!(get(&bearer(READ)).starts_with("HTTP/1.1 200"));
    for open in ["/healthz", "/readyz", "/metrics"] {
        let response = http_with(addr, "GET", open, "", "");
        assert!(response.starts_with("HTTP/1.1 200"), "{open}: {response}");
    }
    assert_eq!(
        policies(&client).await,
        before,
        "a refused call changed policies"
    );

    // The admin token changes things over HTTP too.
    assert!(post(&bearer(ADMIN)).starts_with("HTTP/1.1 200"));
    assert_eq!(policies(&client).await.len(), before.len() + 1);
}

/// Runs `sluicectl` against `grpc` with `SLUICE_TOKEN` set to
/// `token_env` (unset for `None`).
fn sluicectl(grpc: &str, args: &[&str], token_env: Option<&str>) -> Output {
    let mut command = Command::new(sluice_tests::binary("sluicectl"));
    command.env_remove("SLUICE_TOKEN");
    if let Some(token) = token_env {
        command.env("SLUICE_TOKEN", token);
    }
    command
        .arg(format!("--server=http://{grpc}"))
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluicectl_sends_its_token_and_tokens_rotate() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(dir.path(), ADMIN);
    let file = dir.path().join("p.yaml");
    std::fs::write(&file, policy("100MB/s")).unwrap();
    let file = file.to_str().unwrap();
    let url = format!("sqlite://{}", dir.path().join("c.db").display());
    let mut command = controller_command(&url);
    command.arg(format!("--token-file={}", tokens.display()));
    let log = dir.path().join("c.log");
    let (controller, ready) = start(command, &log);
    let grpc = ready["grpc"].as_str().unwrap();

    let out = sluicectl(grpc, &["--token", ADMIN, "apply", "-f", file], None);
    assert!(out.status.success(), "{out:?}");
    // A read token lists and describes everything.
    for what in ["policies", "stages", "jobs", "pools", "datasets"] {
        let out = sluicectl(grpc, &["get", what], Some(READ));
        assert!(out.status.success(), "get {what}: {out:?}");
    }
    let stderr = |out: &Output| String::from_utf8_lossy(&out.stderr).into_owned();
    let out = sluicectl(grpc, &["apply", "-f", file], Some(READ));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "sluicectl: the token is read-only: ApplyPolicies needs an admin token; give one with \
         --token or SLUICE_TOKEN\n"
    );
    let out = sluicectl(grpc, &["get", "stages"], None);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "sluicectl: a bearer token is required (`Authorization: Bearer TOKEN`); give a valid \
         token with --token or SLUICE_TOKEN\n"
    );

    // Rotation: a new admin token replaces the old one in the file.
    let rotated = "admin-rotated-0123456789";
    token_file(dir.path(), rotated);
    let client = admin(grpc).await;
    eventually("the rotated token to be in force", WAIT, || async {
        let old = client
            .clone()
            .list_stages(with(ListStagesRequest {}, Some(ADMIN)))
            .await;
        let new = client
            .clone()
            .list_stages(with(ListStagesRequest {}, Some(rotated)))
            .await;
        (old.is_err() && new.is_ok()).then_some(())
    })
    .await;
    // SIGHUP reads the file at once and does not stop the controller.
    let pid = controller.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    eventually("the controller to re-read the file", WAIT, || async {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        log.contains("admin tokens unchanged").then_some(())
    })
    .await;
    let out = sluicectl(grpc, &["get", "pools"], Some(rotated));
    assert!(out.status.success(), "{out:?}");
    // Every line deleted revokes every token (they stayed in force).
    std::fs::write(dir.path().join("tokens.new"), "# revoked\n").unwrap();
    std::fs::rename(dir.path().join("tokens.new"), &tokens).unwrap();
    eventually("every token to be revoked", WAIT, || async {
        let out = sluicectl(grpc, &["get", "pools"], Some(rotated));
        (!out.status.success()).then_some(())
    })
    .await;
    let out = sluicectl(grpc, &["get", "pools"], Some(READ));
    assert!(
        stderr(&out).contains("not one this controller accepts"),
        "{out:?}"
    );
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("the token file holds no token"), "{log}");
    assert!(
        !log.contains(ADMIN) && !log.contains(READ) && !log.contains(rotated),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_admin_api_needs_tokens_or_insecure_admin() {
    let dir = tempfile::tempdir().unwrap();
    let url = |name: &str| format!("sqlite://{}", dir.path().join(name).display());

    // Loopback without tokens: today's behaviour, with a warning.
    let log = dir.path().join("loopback.log");
    let (_loopback, _) = start(controller_command(&url("a.db")), &log);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("no --token-file: every caller of the admin API is admin"),
        "{text}"
    );

    // Beyond loopback without tokens: exit 64 with what to do.
    let mut refused = controller_command_at(&url("b.db"), "0.0.0.0:0")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = eventually("the refused controller to exit", WAIT, || {
        let done = refused.try_wait().unwrap();
        async move { done }
    })
    .await;
    assert_eq!(status.code(), Some(64));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut refused.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.starts_with(
            "sluice-controller: invalid configuration: --grpc-addr: 0.0.0.0:0 is not a loopback \
             address and no --token-file is given"
        ) && stderr.contains("--insecure-admin"),
        "{stderr}"
    );

    // --insecure-admin accepts it, and says so.
    let mut command = controller_command_at(&url("c.db"), "0.0.0.0:0");
    command.arg("--insecure-admin");
    let log = dir.path().join("insecure.log");
    let (_insecure, ready) = start(command, &log);
    assert!(ready["grpc"].as_str().unwrap().starts_with("0.0.0.0:"));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("--insecure-admin: every caller"), "{text}");

    // With tokens it starts and guards the API.
    let tokens = token_file(dir.path(), ADMIN);
    let mut command = controller_command_at(&url("d.db"), "0.0.0.0:0");
    command.arg(format!("--token-file={}", tokens.display()));
    let (_guarded, ready) = start(command, &dir.path().join("guarded.log"));
    let port = ready["grpc"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let mut client = admin(&format!("127.0.0.1:{port}")).await;
    let (got, _) = code(client.list_stages(with(ListStagesRequest {}, None)).await);
    assert_eq!(got, Code::Unauthenticated);
}
