//! `sluicectl delete policy NAME` and `delete pool NAME`: the controller
//! records the deletion as a new revision, which is printed.

use sluice_proto::v1;

use crate::args::DeleteTarget;
use crate::client::{self, Controller};
use crate::exit::Exit;

/// Runs `delete`: prints `policy/NAME deleted (revision N)`.
pub fn run(controller: &Controller, target: &DeleteTarget) -> Exit {
    let (word, kind, name) = match target {
        // Empty kind: whichever kind has a policy of this name.
        DeleteTarget::Policy { name } => ("policy", "", name),
        DeleteTarget::Pool { name } => ("pool", "StoragePool", name),
    };
    let request = v1::DeletePolicyRequest {
        kind: kind.to_owned(),
        name: name.clone(),
    };
    let response = client::block_on(client::call(controller, |mut admin| async move {
        admin.delete_policy(request).await
    }));
    match response {
        Ok(deleted) => {
            println!("{word}/{name} deleted (revision {})", deleted.revision);
            Exit::Ok
        }
        Err(e) => client::report(&e),
    }
}
