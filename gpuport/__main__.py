from gpuport.cli.main import main

main()
