//! JSON Web Tokens for the RequestAuthentication tests and `bench l7`: signing keys made
//! on the spot (never a fixed key checked in), their public JWKs, and tokens signed with
//! them.

use anyhow::{Context, Result};

/// A signing key a test (or the bench) makes and its public JWK.
pub struct TestKey {
    pub enc: jsonwebtoken::EncodingKey,
    pub alg: jsonwebtoken::Algorithm,
    pub jwk: serde_json::Value,
}

/// Base64url without padding, as JWTs and JWKs spell bytes.
pub fn b64url(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// ES256 with rcgen (P-256, PKCS#8).
pub fn es256_key(kid: &str) -> Result<TestKey> {
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let raw = kp.public_key_raw();
    let jwk = serde_json::json!({"kty": "EC", "crv": "P-256", "kid": kid, "alg": "ES256", "x": b64url(&raw[1..33]), "y": b64url(&raw[33..65])});
    Ok(TestKey {
        enc: jsonwebtoken::EncodingKey::from_ec_der(&kp.serialize_der()),
        alg: jsonwebtoken::Algorithm::ES256,
        jwk,
    })
}

/// RS256 with the openssl CLI (2048 bits, PKCS#1).
pub fn rs256_key(dir: &std::path::Path, kid: &str) -> Result<TestKey> {
    let pem = dir.join(format!("{kid}.pem"));
    let der = dir.join(format!("{kid}.der"));
    let run = |args: &[&str]| -> Result<String> {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .context("openssl")?;
        anyhow::ensure!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    };
    let (pem_s, der_s) = (pem.display().to_string(), der.display().to_string());
    run(&["genrsa", "-out", &pem_s, "2048"])?;
    run(&[
        "rsa",
        "-in",
        &pem_s,
        "-traditional",
        "-outform",
        "DER",
        "-out",
        &der_s,
    ])?;
    let modulus = run(&["rsa", "-in", &pem_s, "-noout", "-modulus"])?;
    let hex = modulus.trim().trim_start_matches("Modulus=");
    let n = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()?;
    let jwk =
        serde_json::json!({"kty": "RSA", "kid": kid, "alg": "RS256", "n": b64url(&n), "e": "AQAB"});
    Ok(TestKey {
        enc: jsonwebtoken::EncodingKey::from_rsa_der(&std::fs::read(&der)?),
        alg: jsonwebtoken::Algorithm::RS256,
        jwk,
    })
}

/// A token with `claims`, signed with `k` (its `kid` in the header).
pub fn sign(k: &TestKey, claims: serde_json::Value) -> Result<String> {
    let mut h = jsonwebtoken::Header::new(k.alg);
    h.kid = k.jwk["kid"].as_str().map(str::to_string);
    Ok(jsonwebtoken::encode(&h, &claims, &k.enc)?)
}
