"""vae: the pack's own streaming video decoders of Wan 2.1 latents (the Wan 2.1 VAE and a TAEHV-class tiny decoder)"""
