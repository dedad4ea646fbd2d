//! Mutual TLS for the controller session (`--tls-cert`, `--tls-key`,
//! `--tls-ca`): the stage presents its certificate and accepts only a
//! controller whose certificate `--tls-ca` signed, for the host name or IP
//! address of the `https://` controller URL.

use std::path::Path;

use sluice_proto::tls::TlsFiles;
use tonic::transport::{ClientTlsConfig, Endpoint};

/// Reads the three files into a client configuration: all three or none
/// (`Ok(None)`). Errors name the flag and the file and say what to fix.
pub fn client_config(
    cert: Option<&Path>,
    key: Option<&Path>,
    ca: Option<&Path>,
) -> Result<Option<ClientTlsConfig>, String> {
    let Some(files) = TlsFiles::read_all_or_none(cert, key, ca).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let tls = files.client();
    // Builds the connector once now, so a key that does not match the
    // certificate stops the start instead of failing every reconnection.
    Endpoint::from_static("https://localhost")
        .tls_config(tls.clone())
        .map_err(|e| {
            format!(
                "--tls-key {} cannot be used with --tls-cert {}: {}",
                key.unwrap_or(Path::new("")).display(),
                cert.unwrap_or(Path::new("")).display(),
                super::error_chain(&e)
            )
        })?;
    Ok(Some(tls))
}
