from paged_jax.serve.cli import main

main()
