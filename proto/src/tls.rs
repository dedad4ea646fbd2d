//! The files of mutual TLS that every party to sluice's gRPC takes, as the
//! `--tls-cert`, `--tls-key` and `--tls-ca` flags name them: the controller
//! (server), the stages and `sluicectl` (clients). Reading them is one
//! thing everywhere: each file is read and checked to hold what its flag
//! says, the key is checked to go with the certificate when the
//! configuration is built (so a bad pair stops the start, not every
//! connection), and an error names the flag and the file.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// How long a client has to finish its TLS handshake: one that sends its
/// handshake a byte at a time is closed then, not kept for as long as it
/// keeps sending.
pub const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

/// A TLS flag whose file is missing, unreadable or not what it must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError {
    /// The flag at fault.
    pub flag: &'static str,
    /// What is wrong and what to write instead.
    pub reason: String,
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.flag, self.reason)
    }
}

impl std::error::Error for TlsError {}

/// The PEM contents of the three files, each checked.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    /// Where the certificate and the key came from, for errors.
    cert_path: PathBuf,
    key_path: PathBuf,
}

impl TlsFiles {
    /// Reads the files given to `--tls-cert`, `--tls-key` and `--tls-ca`.
    pub fn read(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert: read_pem("--tls-cert", cert, Pem::Certificates)?,
            key: read_pem("--tls-key", key, Pem::PrivateKey)?,
            ca: read_pem("--tls-ca", ca, Pem::Certificates)?,
            cert_path: cert.to_owned(),
            key_path: key.to_owned(),
        })
    }

    /// Reads the files when all three flags are given, `None` when none is;
    /// one or two of them is an error naming the first one missing.
    pub fn read_all_or_none(
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
    ) -> Result<Option<Self>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Self::read(cert, key, ca).map(Some),
            (cert, key, _) => Err(TlsError {
                flag: match (cert, key) {
                    (None, _) => "--tls-cert",
                    (_, None) => "--tls-key",
                    _ => "--tls-ca",
                },
                reason: "missing: --tls-cert, --tls-key and --tls-ca go together (give all \
                         three for mutual TLS, or none)"
                    .into(),
            }),
        }
    }

    /// A client that presents the certificate and accepts only a server
    /// whose certificate the CA signed.
    pub fn client(self) -> Result<ClientTlsConfig, TlsError> {
        let tls = ClientTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .ca_certificate(Certificate::from_pem(&self.ca));
        Endpoint::from_static("https://localhost")
            .tls_config(tls.clone())
            .map_err(|e| self.unusable(&e))?;
        Ok(tls)
    }

    /// A server that presents the certificate and requires client
    /// certificates the CA signed, within [`HANDSHAKE`] of connecting.
    pub fn server(self) -> Result<ServerTlsConfig, TlsError> {
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
            .timeout(HANDSHAKE);
        Server::builder()
            .tls_config(tls.clone())
            .map_err(|e| self.unusable(&e))?;
        Ok(tls)
    }

    /// The error of a key and certificate that rustls cannot use together.
    fn unusable(&self, e: &dyn std::error::Error) -> TlsError {
        TlsError {
            flag: "--tls-key",
            reason: format!(
                "{} cannot be used with --tls-cert {}: {}",
                self.key_path.display(),
                self.cert_path.display(),
                crate::error_chain(e)
            ),
        }
    }
}

/// What a PEM file must hold.
#[derive(Debug, Clone, Copy)]
enum Pem {
    Certificates,
    PrivateKey,
}

/// Reads `path` and checks it holds what `kind` says, naming the file when
/// it does not.
fn read_pem(flag: &'static str, path: &Path, kind: Pem) -> Result<Vec<u8>, TlsError> {
    let fail = |reason: String| TlsError { flag, reason };
    let bytes =
        std::fs::read(path).map_err(|e| fail(format!("cannot read {}: {e}", path.display())))?;
    let valid = match kind {
        Pem::Certificates => {
            let mut certs = CertificateDer::pem_slice_iter(&bytes).peekable();
            certs.peek().is_some() && certs.all(|c| c.is_ok())
        }
        Pem::PrivateKey => PrivateKeyDer::from_pem_slice(&bytes).is_ok(),
    };
    if !valid {
        let wanted = match kind {
            Pem::Certificates => "certificates (-----BEGIN CERTIFICATE-----)",
            Pem::PrivateKey => "a private key (-----BEGIN PRIVATE KEY-----, PKCS#8, RSA or EC)",
        };
        return Err(fail(format!(
            "{} is not a valid PEM file: it must hold {wanted}",
            path.display()
        )));
    }
    Ok(bytes)
}
