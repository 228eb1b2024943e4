//! Certificates made with `openssl` for the TLS tests.

#[allow(unused_imports)]
use super::*;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA (`<name>.pem`, `<name>.key`) in `dir`.
pub fn make_ca(dir: &Path, name: &str) {
    let (key, pem, subject) = (format!("{name}.key"), format!("{name}.pem"), format!("/CN={name}"));
    let mut args = vec!["req", "-x509"];
    args.extend(NEW_EC_KEY);
    args.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subject]);
    openssl(dir, &args);
}

/// `openssl req` arguments for a new P-256 key, unencrypted.
const NEW_EC_KEY: [&str; 5] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];

/// A leaf certificate `<name>.pem` / `<name>.key` signed by CA `ca`, for
/// `usage` (`serverAuth` or `clientAuth`).
pub fn make_leaf(dir: &Path, ca: &str, name: &str, usage: &str) {
    make_leaf_for(dir, ca, name, usage, "DNS:localhost,IP:127.0.0.1");
}

/// [`make_leaf`] with the subject alternative names `san` (openssl's form).
pub fn make_leaf_for(dir: &Path, ca: &str, name: &str, usage: &str, san: &str) {
    let (key, csr, subject) = (format!("{name}.key"), format!("{name}.csr"), format!("/CN={name}"));
    let mut args = vec!["req"];
    args.extend(NEW_EC_KEY);
    args.extend(["-keyout", &key, "-out", &csr, "-subj", &subject]);
    openssl(dir, &args);
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            ext.to_str().unwrap(),
        ],
    );
}
