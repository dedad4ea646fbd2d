//! Mutual TLS for the controller session (`--tls-cert`, `--tls-key`,
//! `--tls-ca`): the stage presents its certificate and accepts only a
//! controller whose certificate `--tls-ca` signed, for the host name or IP
//! address of the `https://` controller URL.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// Reads the three files into a client configuration: all three or none
/// (`Ok(None)`). Errors name the flag and the file and say what to fix.
pub fn client_config(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
) -> Result<Option<ClientTlsConfig>, String> {
    let (cert, key, ca) = match (cert, key, ca) {
        (None, None, None) => return Ok(None),
        (Some(cert), Some(key), Some(ca)) => (cert, key, ca),
        (cert, key, _) => {
            let missing = match (cert, key) {
                (None, _) => "--tls-cert",
                (_, None) => "--tls-key",
                _ => "--tls-ca",
            };
            return Err(format!(
                "{missing} is missing: --tls-cert, --tls-key and --tls-ca go together \
                 (give all three for mutual TLS with the controller, or none)"
            ));
        }
    };
    let identity = Identity::from_pem(certificates("--tls-cert", &cert)?, private_key(&key)?);
    let tls = ClientTlsConfig::new()
        .identity(identity)
        .ca_certificate(Certificate::from_pem(certificates("--tls-ca", &ca)?));
    // Builds the connector once now, so a key that does not match the
    // certificate stops the start instead of failing every reconnection.
    Endpoint::from_static("https://localhost")
        .tls_config(tls.clone())
        .map_err(|e| {
            format!(
                "--tls-key {} cannot be used with --tls-cert {}: {}",
                key.display(),
                cert.display(),
                super::error_chain(&e)
            )
        })?;
    Ok(Some(tls))
}

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag}: cannot read {}: {e}", path.display()))
}

/// Reads a PEM file of one or more certificates.
fn certificates(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    let pem = read(flag, path)?;
    let mut certs = CertificateDer::pem_slice_iter(&pem).peekable();
    if certs.peek().is_none() || !certs.all(|c| c.is_ok()) {
        return Err(format!(
            "{flag}: {} is not a valid PEM file: it must hold certificates \
             (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(pem)
}

/// Reads a PEM private key (PKCS#8, RSA or EC).
fn private_key(path: &Path) -> Result<Vec<u8>, String> {
    let pem = read("--tls-key", path)?;
    if PrivateKeyDer::from_pem_slice(&pem).is_err() {
        return Err(format!(
            "--tls-key: {} is not a valid PEM file: it must hold a private key \
             (-----BEGIN PRIVATE KEY-----, PKCS#8, RSA or EC)",
            path.display()
        ));
    }
    Ok(pem)
}
