from jet.cli.main import main

main()
