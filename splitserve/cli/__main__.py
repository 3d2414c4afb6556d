"""`python -m splitserve.cli`: how `splitserve up`, Docker and Kubernetes start each service
(`python -m splitserve.cli serve SERVICE`)."""

from splitserve.cli.app import main

main()
